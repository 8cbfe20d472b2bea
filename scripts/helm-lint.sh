#!/usr/bin/env bash
# Lints and renders the Helm chart charts/capyctl with Helm's own library, without a helm binary
# or a cluster, and checks what it renders. Run from anywhere: `bash scripts/helm-lint.sh`.
#
# Helm's library comes from the PyPI package helm-sdkpy, installed into a virtual environment
# under target/helm-lint/ when missing (scripts/helm-venv.sh, shared with scripts/helm).
#
# For the default values, for charts/capyctl/ci/all-on-values.yaml (every option on) and for
# charts/capyctl/values-local.yaml (the local cluster's), and for it with values-local-vllm.yaml
# over it (the real vLLM's):
#   1. render: Helm's install action against a fake API server in this script (discovery, and
#      objects accepted and kept in memory), which gives the rendered manifest, `lookup` and
#      all; every object is checked (names, labels, selectors, ports, RBAC without wildcards);
#   2. the rendered server.yaml and host.yaml are checked with `capyctl check server|host`;
#   3. lint: Helm's Lint action on a copy of the chart whose values.yaml is the merged values;
#      any error or warning fails.
# Then: a second install that finds the generated Secrets keeps their tokens (lookup), and bad
# values (out of range, unknown keys, bare-number durations, ...) fail to render with the key,
# the value and the range. The RBAC the default values render must be
# operator/tests/k8s_rbac.yaml (which the needs-cluster RBAC test applies); with
# CAPYCTL_HELM_LINT_WRITE=1 the script rewrites that file instead of failing.
#
# Exits non-zero on the first failure, naming it.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/helm-venv.sh
. scripts/helm-venv.sh

echo "== helm-lint: building capyctl (to check the rendered documents)"
cargo build -q -p capyctl
CAPYCTL_BIN="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/debug/capyctl"
export CAPYCTL_BIN

exec "$VENV/bin/python" - charts/capyctl <<'PYTHON'
import asyncio
import copy
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

import yaml
import helm_sdkpy as helm

CHART = os.path.abspath(sys.argv[1])
CAPYCTL = os.environ["CAPYCTL_BIN"]
NAMESPACE = "capyctl-system"
RELEASE = "capyctl"
FAILURES = []


def fail(msg):
    print(f"FAIL: {msg}", flush=True)
    FAILURES.append(msg)


# ------------------------------------------------------------------------------------------
# A fake Kubernetes API server: discovery for every kind the chart may render, objects kept in
# memory (CRDs reported Established), everything else 404.
# ------------------------------------------------------------------------------------------
RESOURCES = {
    # groupVersion: [(plural, kind, namespaced)]
    "v1": [("configmaps", "ConfigMap", True), ("secrets", "Secret", True),
           ("services", "Service", True), ("serviceaccounts", "ServiceAccount", True),
           ("pods", "Pod", True), ("events", "Event", True), ("namespaces", "Namespace", False)],
    "apps/v1": [("deployments", "Deployment", True), ("daemonsets", "DaemonSet", True)],
    "rbac.authorization.k8s.io/v1": [("roles", "Role", True), ("rolebindings", "RoleBinding", True),
                                     ("clusterroles", "ClusterRole", False),
                                     ("clusterrolebindings", "ClusterRoleBinding", False)],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True)],
    "coordination.k8s.io/v1": [("leases", "Lease", True)],
    "networking.k8s.io/v1": [("networkpolicies", "NetworkPolicy", True)],
    "node.k8s.io/v1": [("runtimeclasses", "RuntimeClass", False)],
    "apiextensions.k8s.io/v1": [("customresourcedefinitions", "CustomResourceDefinition", False)],
    "monitoring.coreos.com/v1": [("servicemonitors", "ServiceMonitor", True)],
    "capyctl.io/v1alpha1": [("deployments", "Deployment", True), ("hosts", "Host", False),
                            ("tenants", "Tenant", True)],
}


class FakeApi:
    def __init__(self, existing=None):
        self.objects = dict(existing or {})  # path -> object
        self.created = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def not_found(self):
                self.send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "NotFound", "code": 404, "message": "not found"})

            def do_GET(self):
                path, _, query = self.path.partition("?")
                if path == "/version":
                    return self.send(200, {"major": "1", "minor": "34", "gitVersion": "v1.34.0",
                                           "platform": "linux/amd64"})
                if path == "/api":
                    return self.send(200, {"kind": "APIVersions", "versions": ["v1"],
                                           "serverAddressByClientCIDRs": []})
                if path == "/apis":
                    groups = []
                    for gv in RESOURCES:
                        if "/" in gv:
                            g, v = gv.split("/")
                            groups.append({"name": g, "versions": [{"groupVersion": gv, "version": v}],
                                           "preferredVersion": {"groupVersion": gv, "version": v}})
                    return self.send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
                for gv, rs in RESOURCES.items():
                    prefix = "/api/v1" if gv == "v1" else f"/apis/{gv}"
                    if path == prefix:
                        return self.send(200, {
                            "kind": "APIResourceList", "groupVersion": gv,
                            "resources": [{"name": p, "singularName": k.lower(), "namespaced": n,
                                           "kind": k, "verbs": ["create", "delete", "get", "list",
                                                                "patch", "update", "watch"]}
                                          for p, k, n in rs]})
                if path in api.objects:
                    return self.send(200, api.objects[path])
                if "labelSelector" in query:  # Helm's release history: none
                    return self.send(200, {"kind": "List", "apiVersion": "v1", "metadata": {},
                                           "items": []})
                return self.not_found()

            def write(self, code):
                n = int(self.headers.get("Content-Length", "0"))
                raw = self.rfile.read(n)
                path = self.path.partition("?")[0]
                try:
                    obj = json.loads(raw)
                except ValueError:  # Helm's release records come as protobuf
                    obj = {"metadata": {"name": path.rstrip("/").split("/")[-1]}}
                meta = obj.setdefault("metadata", {})
                meta.setdefault("uid", "00000000-0000-0000-0000-000000000000")
                meta["resourceVersion"] = "1"
                if obj.get("kind") == "CustomResourceDefinition":
                    obj["status"] = {"conditions": [
                        {"type": "Established", "status": "True"},
                        {"type": "NamesAccepted", "status": "True"}],
                        "acceptedNames": obj.get("spec", {}).get("names", {})}
                key = path if self.command != "POST" else f"{path}/{meta.get('name', '')}"
                api.objects[key] = obj
                if self.command == "POST" and "kind" in obj:
                    api.created.append(obj)
                return self.send(code, obj)

            def do_POST(self):
                self.write(201)

            def do_PUT(self):
                self.write(200)

            def do_PATCH(self):
                n = int(self.headers.get("Content-Length", "0"))
                path = self.path.partition("?")[0]
                if path not in api.objects:
                    return self.not_found()
                try:
                    patch = json.loads(self.rfile.read(n))
                except ValueError:
                    patch = {}

                def apply(target, p):
                    for k, v in p.items():
                        if v is None:
                            target.pop(k, None)
                        elif isinstance(v, dict) and isinstance(target.get(k), dict):
                            apply(target[k], v)
                        else:
                            target[k] = v
                apply(api.objects[path], patch)
                return self.send(200, api.objects[path])

            def do_DELETE(self):
                self.send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.dir = tempfile.mkdtemp(prefix="capyctl-helm-")
        self.kubeconfig = os.path.join(self.dir, "kubeconfig")
        port = self.server.server_address[1]
        with open(self.kubeconfig, "w") as f:
            f.write(f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: fake, namespace: {NAMESPACE}}}}}]
current-context: fake
users: [{{name: fake, user: {{token: fake}}}}]
""")

    def close(self):
        self.server.shutdown()
        shutil.rmtree(self.dir, ignore_errors=True)


def render(values, existing=None):
    """Installs the chart into a fresh fake API server; returns (objects, error text)."""
    api = FakeApi(existing)
    try:
        config = helm.Configuration(namespace=NAMESPACE, kubeconfig=api.kubeconfig)
        result = asyncio.run(helm.Install(config).run(RELEASE, CHART, values=values, wait=False,
                                                      timeout=60))
        docs = [d for d in yaml.safe_load_all(result.get("manifest", "")) if d]
        return docs, None
    except helm.HelmError as e:
        return None, str(e)
    finally:
        api.close()


# ------------------------------------------------------------------------------------------
# Checks of the rendered objects
# ------------------------------------------------------------------------------------------
def by_kind(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def one(docs, kind, name_suffix):
    hits = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    if len(hits) != 1:
        fail(f"expected one {kind} named *{name_suffix}, found {len(hits)}")
        return None
    return hits[0]


def check_document(kind, text, case):
    with tempfile.NamedTemporaryFile("w", suffix=f"-{kind}.yaml", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        out = subprocess.run([CAPYCTL, "check", kind, "--file", path], capture_output=True,
                             text=True, env={k: v for k, v in os.environ.items()
                                             if not k.startswith("CAPYCTL_SET__")})
        if out.returncode != 0:
            fail(f"{case}: rendered {kind}.yaml refused by `capyctl check {kind}`: "
                 f"{out.stderr.strip()}\n{text}")
        return out.stdout
    finally:
        os.unlink(path)


def containers_ports(pod_spec):
    return {p["name"]: p["containerPort"] for c in pod_spec["containers"] for p in c.get("ports", [])}


def check_objects(docs, values, case):
    names = set()
    for d in docs:
        for key in ("apiVersion", "kind", "metadata"):
            if key not in d:
                fail(f"{case}: an object without {key}: {d}")
        meta = d.get("metadata", {})
        ident = (d.get("apiVersion"), d.get("kind"), meta.get("namespace"), meta.get("name"))
        if ident in names:
            fail(f"{case}: {ident} rendered twice")
        names.add(ident)
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", meta.get("name", "")):
            fail(f"{case}: {d.get('kind')} has an invalid name {meta.get('name')!r}")
        # Only the Roles of operator.watchNamespaces are elsewhere: in those namespaces.
        watched = values.get("operator", {}).get("watchNamespaces") or []
        elsewhere = d["kind"] in ("Role", "RoleBinding") and meta.get("namespace") in watched
        if d["kind"] not in ("ClusterRole", "ClusterRoleBinding") and meta.get("namespace") != NAMESPACE \
                and not elsewhere:
            fail(f"{case}: {d['kind']} {meta.get('name')} is not in the release namespace")
        labels = meta.get("labels", {})
        for label in ("app.kubernetes.io/name", "app.kubernetes.io/instance",
                      "app.kubernetes.io/component", "helm.sh/chart"):
            if label not in labels:
                fail(f"{case}: {d['kind']} {meta.get('name')} lacks the label {label}")

    # The documents.
    cms = {d["metadata"]["name"]: d for d in by_kind(docs, "ConfigMap")}
    op_cm = cms.get(f"{RELEASE}-operator")
    server_out = ""
    if op_cm is None or "server.yaml" not in op_cm.get("data", {}):
        fail(f"{case}: no ConfigMap {RELEASE}-operator with server.yaml")
    else:
        server_out = check_document("server", op_cm["data"]["server.yaml"], case)
        pods_doc = yaml.safe_load(op_cm["data"]["engine-pods.yaml"])
        if not pods_doc.get("resources", {}).get("requests"):
            fail(f"{case}: engine-pods.yaml gives engine Pods no resource requests (BestEffort)")
    host_out = ""
    if values.get("nodeAgent", {}).get("enabled", True):
        agent_cm = cms.get(f"{RELEASE}-node-agent")
        if agent_cm is None or "host.yaml" not in agent_cm.get("data", {}):
            fail(f"{case}: no ConfigMap {RELEASE}-node-agent with host.yaml")
        else:
            host_out = check_document("host", agent_cm["data"]["host.yaml"], case)
            if op_cm is not None and op_cm["data"].get("host.yaml") != agent_cm["data"]["host.yaml"]:
                fail(f"{case}: the operator's host.yaml is not the node agents'")

    # The operator.
    dep = one(docs, "Deployment", "-operator")
    if dep:
        spec = dep["spec"]
        want = values.get("operator", {}).get("replicas", 2)
        if spec["replicas"] != want:
            fail(f"{case}: operator replicas {spec['replicas']}, want {want}")
        pod = spec["template"]["spec"]
        c = pod["containers"][0]
        if c.get("args", [])[:2] != ["--file", "/etc/capyctl/server.yaml"]:
            fail(f"{case}: operator args {c.get('args')} do not start with --file /etc/capyctl/server.yaml")
        env = {e["name"]: e for e in c.get("env", [])}
        for name, field in (("POD_NAMESPACE", "metadata.namespace"), ("POD_NAME", "metadata.name")):
            if env.get(name, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != field:
                fail(f"{case}: operator env {name} is not the downward API's {field}")
        # The Lease's owner: this Deployment, which the operator may read (and only it).
        if env.get("CAPYCTL_OPERATOR_DEPLOYMENT", {}).get("value") != dep["metadata"]["name"]:
            fail(f"{case}: operator env CAPYCTL_OPERATOR_DEPLOYMENT is not its Deployment's name {dep['metadata']['name']}")
        roles = [d for d in by_kind(docs, "Role") if d["metadata"]["name"] == dep["metadata"]["name"]
                 and d["metadata"].get("namespace") == dep["metadata"].get("namespace")]
        if values.get("rbac", {}).get("create", True):
            if not any(r.get("apiGroups") == ["apps"] and r.get("resources") == ["deployments"]
                       and r.get("resourceNames") == [dep["metadata"]["name"]] and r.get("verbs") == ["get"]
                       for role in roles for r in role.get("rules", [])):
                fail(f"{case}: the operator's Role does not grant get on its own Deployment (deployments.apps {dep['metadata']['name']}) alone")
        for name, file in (("CAPYCTL_ENGINE_PODS_FILE", "engine-pods.yaml"), ("CAPYCTL_HOST_FILE", "host.yaml")):
            if env.get(name, {}).get("value") != f"/etc/capyctl/{file}":
                fail(f"{case}: operator env {name} is not /etc/capyctl/{file}")
        ports = containers_ports(pod)
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            get = c.get(probe, {}).get("httpGet", {})
            if get.get("path") != path or get.get("port") != "management":
                fail(f"{case}: operator {probe} is not GET {path} on the management port")
        if set(ports) != {"inference", "management"}:
            fail(f"{case}: operator ports {ports}")
        if op_cm is not None:
            listen = yaml.safe_load(op_cm["data"]["server.yaml"])["listen"]
            for name in ("inference", "management"):
                if not listen[name].endswith(f":{ports.get(name)}"):
                    fail(f"{case}: container port {name}={ports.get(name)} is not the port of "
                         f"server.yaml's listen.{name} ({listen[name]})")
        if pod.get("serviceAccountName") is None:
            fail(f"{case}: operator without a service account")
        check_mounts(pod, case, "operator")
        pod_labels = spec["template"]["metadata"]["labels"]
        for svc_suffix, port_name in (("-router", "inference"), ("-management", "management")):
            svc = one(docs, "Service", svc_suffix)
            if not svc:
                continue
            sel = svc["spec"]["selector"]
            extra = {k: v for k, v in sel.items() if pod_labels.get(k) != v}
            if extra and set(extra) != {"capyctl.io/leader"}:
                fail(f"{case}: Service {svc['metadata']['name']} selector {sel} does not select the operator Pods")
            for p in svc["spec"]["ports"]:
                if p["targetPort"] != port_name:
                    fail(f"{case}: Service {svc['metadata']['name']} targets {p['targetPort']}, not {port_name}")
        pdbs = by_kind(docs, "PodDisruptionBudget")
        for pdb in pdbs:
            if pdb["spec"]["selector"]["matchLabels"] != spec["selector"]["matchLabels"]:
                fail(f"{case}: the PodDisruptionBudget does not select the operator")

    # The node agent.
    if values.get("nodeAgent", {}).get("enabled", True):
        ds = one(docs, "DaemonSet", "-node-agent")
        if ds:
            pod = ds["spec"]["template"]["spec"]
            if pod.get("nodeSelector", {}).get("capyctl.io/gpu-host") != "true":
                fail(f"{case}: the node agent's nodeSelector lacks capyctl.io/gpu-host=true")
            c = pod["containers"][0]
            env = {e["name"]: e for e in c.get("env", [])}
            if env.get("NODE_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") != "spec.nodeName":
                fail(f"{case}: node agent NODE_NAME is not spec.nodeName")
            args = c.get("args", [])
            if args[:2] != ["--file", "/etc/capyctl/host.yaml"] or "--engine-runtime" not in args:
                fail(f"{case}: node agent args {args}")
            check_mounts(pod, case, "node agent")
            # The engines' records outlive the agent's Pod: CAPYCTL_DATA_DIR is a hostPath.
            data_dir = env.get("CAPYCTL_DATA_DIR", {}).get("value")
            mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"] == data_dir), None)
            volume = next((v for v in pod.get("volumes", []) if mount and v["name"] == mount["name"]), None)
            if not data_dir or not volume or "hostPath" not in volume:
                fail(f"{case}: the node agent's CAPYCTL_DATA_DIR ({data_dir}) is not a mounted hostPath")
            if "CAPYCTL_OPERATOR_URL" in env:
                fail(f"{case}: the node agent gets CAPYCTL_OPERATOR_URL, which it does not use")
            for init in pod.get("initContainers", []):
                caps = init.get("securityContext", {}).get("capabilities", {})
                if caps.get("drop") != ["ALL"] or caps.get("add") != ["CHOWN", "FOWNER"]:
                    fail(f"{case}: init container {init['name']} has capabilities {caps}")
            check_mounts(dict(pod, containers=pod.get("initContainers", [])), case, "node agent init")

    # RBAC: no wildcards, ClusterRoles only for cluster-scoped kinds (and, with
    # operator.watchNamespaces ["*"], for the Deployment objects of every namespace).
    watch_all = values.get("operator", {}).get("watchNamespaces") == ["*"]
    for role in by_kind(docs, "Role") + by_kind(docs, "ClusterRole"):
        for rule in role.get("rules", []):
            for key in ("apiGroups", "resources", "verbs"):
                if "*" in rule.get(key, []):
                    fail(f"{case}: {role['kind']} {role['metadata']['name']} has a wildcard in {key}")
            if role["kind"] == "ClusterRole":
                for r in rule.get("resources", []):
                    if (watch_all and role["metadata"]["name"].endswith("-operator-deployments")
                            and r in ("deployments", "deployments/status", "events")):
                        continue
                    if r.split("/")[0] not in ("hosts", "nodes"):
                        fail(f"{case}: ClusterRole {role['metadata']['name']} grants {r}, which is namespaced (only hosts and nodes are cluster-scoped)")
    for b in by_kind(docs, "RoleBinding") + by_kind(docs, "ClusterRoleBinding"):
        ref = b["roleRef"]
        if not any(r["metadata"]["name"] == ref["name"] and r["kind"] == ref["kind"]
                   for r in by_kind(docs, ref["kind"])):
            fail(f"{case}: {b['kind']} {b['metadata']['name']} refers to a missing {ref['kind']} {ref['name']}")
        for s in b["subjects"]:
            if not any(sa["metadata"]["name"] == s["name"] for sa in by_kind(docs, "ServiceAccount")):
                fail(f"{case}: {b['kind']} {b['metadata']['name']} binds a missing ServiceAccount {s['name']}")

    # Secrets.
    for s in by_kind(docs, "Secret"):
        token = s.get("data", {}).get("token")
        if not token:
            fail(f"{case}: Secret {s['metadata']['name']} has no token")
    return docs


def check_mounts(pod, case, who):
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                fail(f"{case}: {who} mounts a missing volume {m['name']}")


# ------------------------------------------------------------------------------------------
# Lint: Helm's Lint action reads the chart's own values.yaml, so each case lints a copy of the
# chart whose values.yaml is the merged values.
# ------------------------------------------------------------------------------------------
SEVERITY = {0: "unknown", 1: "info", 2: "warning", 3: "error"}


def merge(base, over):
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def lint(values, case):
    tmp = tempfile.mkdtemp(prefix="capyctl-lint-")
    try:
        chart = os.path.join(tmp, "capyctl")
        shutil.copytree(CHART, chart)
        with open(os.path.join(CHART, "values.yaml")) as f:
            defaults = yaml.safe_load(f)
        with open(os.path.join(chart, "values.yaml"), "w") as f:
            yaml.safe_dump(merge(defaults, values), f, sort_keys=False)
        config = helm.Configuration(namespace=NAMESPACE)
        result = asyncio.run(helm.Lint(config).run(chart))
        bad = [m for m in result.get("Messages", []) if m.get("Severity", 0) >= 2]
        for m in result.get("Messages", []):
            print(f"   lint {SEVERITY.get(m.get('Severity'), m.get('Severity'))}: {m.get('Path')} "
                  f"{m.get('Err') or ''}")
        if bad or result.get("Errors"):
            fail(f"{case}: helm lint reported {len(bad)} warning(s)/error(s) (paths above; "
                 "the render step above names template errors)")
    except helm.HelmError as e:
        fail(f"{case}: helm lint failed: {e}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# The cases
# ------------------------------------------------------------------------------------------
with open(os.path.join(CHART, "ci", "all-on-values.yaml")) as f:
    ALL_ON = yaml.safe_load(f) or {}
with open(os.path.join(CHART, "values-local.yaml")) as f:
    LOCAL = yaml.safe_load(f) or {}
with open(os.path.join(CHART, "values-local-vllm.yaml")) as f:
    LOCAL_VLLM = yaml.safe_load(f) or {}


def merged(base, over):
    """Helm's merge of two values files: maps key by key, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


for case, values in (("default values", {}), ("ci/all-on-values.yaml", ALL_ON),
                     ("values-local.yaml", LOCAL),
                     ("values-local.yaml + values-local-vllm.yaml", merged(LOCAL, LOCAL_VLLM))):
    print(f"== {case}: render", flush=True)
    docs, err = render(values)
    if err:
        fail(f"{case}: the chart does not render: {err}")
        continue
    check_objects(docs, values, case)
    kinds = sorted({f"{d['kind']}" for d in docs})
    print(f"   {len(docs)} objects: {', '.join(kinds)}")
    print(f"== {case}: lint", flush=True)
    lint(values, case)

print("== all-on: every option renders", flush=True)
docs, err = render(ALL_ON)
if docs:
    kinds = {d["kind"] for d in docs}
    for kind in ("ServiceMonitor", "PodDisruptionBudget", "DaemonSet", "ClusterRole", "NetworkPolicy"):
        if kind not in kinds:
            fail(f"all-on: no {kind} rendered")
    server = yaml.safe_load(next(d for d in docs if d["kind"] == "ConfigMap"
                                 and d["metadata"]["name"].endswith("-operator"))["data"]["server.yaml"])
    if "tls" not in server["listen"] or "lifecycle_defaults" not in server:
        fail("all-on: server.yaml lacks listen.tls or lifecycle_defaults")

print("== operator.watchNamespaces: the operator's setting, the RBAC and the management Service's annotation", flush=True)


def watch_render(values, case):
    docs, err = render(values)
    if err:
        fail(f"{case}: {err}")
        return None, None, None
    check_objects(docs, values, case)
    dep = one(docs, "Deployment", "-operator")
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    svc = one(docs, "Service", "-management")
    return docs, env.get("CAPYCTL_WATCH_NAMESPACES"), svc["metadata"].get("annotations", {}).get("capyctl.io/watch-namespaces")


WATCHED_RULES = {("capyctl.io", "deployments"): ["get", "list", "watch", "patch"],
                 ("capyctl.io", "deployments/status"): ["patch"],
                 ("events.k8s.io", "events"): ["create", "patch"]}


def rules_of(role):
    return {(g, r): rule["verbs"] for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}


docs, env, note = watch_render({}, "watchNamespaces default")
if docs is not None:
    if env != "" or note != NAMESPACE:
        fail(f"watchNamespaces default: CAPYCTL_WATCH_NAMESPACES={env!r}, annotation {note!r}; want '' and {NAMESPACE!r}")
    if any(d["metadata"].get("namespace", NAMESPACE) != NAMESPACE for d in docs):
        fail("watchNamespaces default: an object outside the release namespace")
listed = {"operator": {"watchNamespaces": ["team-a", "team-b", NAMESPACE, "team-a"]}}
docs, env, note = watch_render(listed, "watchNamespaces [team-a, team-b]")
if docs is not None:
    if env != "team-a,team-b" or note != f"{NAMESPACE},team-a,team-b":
        fail(f"watchNamespaces list: CAPYCTL_WATCH_NAMESPACES={env!r}, annotation {note!r}")
    sa = one(docs, "ServiceAccount", "-operator")["metadata"]["name"]
    for ns in ("team-a", "team-b"):
        roles = [r for r in by_kind(docs, "Role") if r["metadata"]["namespace"] == ns]
        binds = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["namespace"] == ns]
        if len(roles) != 1 or rules_of(roles[0]) != WATCHED_RULES:
            fail(f"watchNamespaces list: namespace {ns}: Roles {[rules_of(r) for r in roles]}; want one with {WATCHED_RULES}")
        elif len(binds) != 1 or binds[0]["roleRef"]["name"] != roles[0]["metadata"]["name"] or \
                binds[0]["subjects"] != [{"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE}]:
            fail(f"watchNamespaces list: namespace {ns}: the RoleBinding does not bind the operator's ServiceAccount to its Role")
    if any(r["metadata"]["name"].endswith("-operator-deployments") for r in by_kind(docs, "ClusterRole")):
        fail("watchNamespaces list: a ClusterRole for every namespace")
docs, env, note = watch_render({"operator": {"watchNamespaces": ["*"]}}, "watchNamespaces [*]")
if docs is not None:
    if env != "*" or note != "*":
        fail(f"watchNamespaces *: CAPYCTL_WATCH_NAMESPACES={env!r}, annotation {note!r}")
    role = one(docs, "ClusterRole", "-operator-deployments")
    bind = one(docs, "ClusterRoleBinding", "-operator-deployments")
    if not role or rules_of(role) != WATCHED_RULES or not bind or bind["roleRef"]["name"] != role["metadata"]["name"]:
        fail("watchNamespaces *: no ClusterRole and ClusterRoleBinding for the Deployment objects of every namespace")
    if any(r["metadata"]["namespace"] != NAMESPACE for r in by_kind(docs, "Role")):
        fail("watchNamespaces *: a Role outside the release namespace")

print("== a host value change rolls the operator (its checksum covers host.yaml)", flush=True)


def operator_checksum(values):
    docs, err = render(values)
    if err:
        fail(f"checksum: render failed: {err}")
        return None
    dep = one(docs, "Deployment", "-operator")
    return dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"] if dep else None


base = operator_checksum({})
for changed in ({"host": {"resource_policy": {"queue": {"admission_window": "750ms"}}}},
                {"host": {"lifecycle": {"activation": "explicit"}}},
                {"host": {"engines": {"vllm": {"env": {"X": "1"}}}}}):
    if base is not None and operator_checksum(changed) == base:
        fail(f"checksum: {changed} does not change the operator's checksum/config")

print("== default values: no ServiceMonitor; the engines' NetworkPolicy admits only the operator and node agents", flush=True)
docs, err = render({})
kinds = {d["kind"] for d in docs or []}
if "ServiceMonitor" in kinds:
    fail("default values: a ServiceMonitor is rendered, but it is off by default")
policy = one(docs or [], "NetworkPolicy", "-engines")
cm = next((d for d in docs or [] if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-operator")), None)
if not policy or cm is None:
    fail("default values: no NetworkPolicy for engine Pods")
else:
    engine_labels = yaml.safe_load(cm["data"]["engine-pods.yaml"])["labels"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    if any(engine_labels.get(k) != v for k, v in selector.items()):
        fail(f"default values: the engines' NetworkPolicy selects {selector}, not the engine Pods' labels {engine_labels}")
    if policy["spec"].get("policyTypes") != ["Ingress"]:
        fail("default values: the engines' NetworkPolicy does not restrict ingress")
    sources = [f["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"] for f in rule["from"]]
    templates = {name: one(docs, kind, suffix)["spec"]["template"]["metadata"]["labels"]
                 for name, kind, suffix in (("operator", "Deployment", "-operator"),
                                            ("node agent", "DaemonSet", "-node-agent"))}
    for name, labels in templates.items():
        if not any(all(labels.get(k) == v for k, v in src.items()) for src in sources):
            fail(f"default values: the engines' NetworkPolicy does not admit the {name} Pods")
    for src in sources:
        if not any(all(labels.get(k) == v for k, v in src.items()) for labels in templates.values()):
            fail(f"default values: the engines' NetworkPolicy admits {src}, which is neither the operator nor a node agent")
off, _ = render({"networkPolicy": {"enabled": False}})
if off and by_kind(off, "NetworkPolicy"):
    fail("networkPolicy.enabled=false still renders a NetworkPolicy")

print("== RBAC: operator/tests/k8s_rbac.yaml is what the default values render", flush=True)
# The needs-cluster test operator/tests/k8s_rbac.rs applies this file to a real API server
# and checks, as each ServiceAccount, what it may and may not do.
RBAC_FILE = os.path.join(os.path.dirname(os.path.dirname(CHART)), "operator", "tests", "k8s_rbac.yaml")
RBAC_KINDS = ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
docs, err = render({})
if docs:
    rbac = [d for d in docs if d["kind"] in RBAC_KINDS]
    rbac.sort(key=lambda d: (RBAC_KINDS.index(d["kind"]), d["metadata"]["name"]))
    text = ("# The chart's RBAC with the default values (release capyctl, namespace capyctl-system),\n"
            "# rendered by scripts/helm-lint.sh; do not edit. operator/tests/k8s_rbac.rs applies it.\n"
            + yaml.safe_dump_all(rbac, sort_keys=True))
    old = open(RBAC_FILE).read() if os.path.exists(RBAC_FILE) else None
    if os.environ.get("CAPYCTL_HELM_LINT_WRITE") == "1":
        if old != text:
            with open(RBAC_FILE, "w") as f:
                f.write(text)
            print(f"   wrote {RBAC_FILE}")
    elif old != text:
        fail(f"{RBAC_FILE} is not what the chart renders: run CAPYCTL_HELM_LINT_WRITE=1 bash scripts/helm-lint.sh and commit it")

print("== tokens: generated once, kept across upgrades (lookup)", flush=True)
first, err = render({})
if first:
    secrets = {s["metadata"]["name"]: s for s in by_kind(first, "Secret")}
    existing = {f"/api/v1/namespaces/{NAMESPACE}/secrets/{name}": {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {"app.kubernetes.io/managed-by": "Helm"},
                     "annotations": {"meta.helm.sh/release-name": RELEASE,
                                     "meta.helm.sh/release-namespace": NAMESPACE}},
        "data": s["data"]} for name, s in secrets.items()}
    again, err = render({}, existing)
    if err:
        fail(f"tokens: second render failed: {err}")
    else:
        for s in by_kind(again, "Secret"):
            name = s["metadata"]["name"]
            if s["data"] != secrets[name]["data"]:
                fail(f"tokens: Secret {name} changed on the second install")
    third, _ = render({})
    if third and all(s["data"] == secrets[s["metadata"]["name"]]["data"] for s in by_kind(third, "Secret")):
        fail("tokens: two fresh installs generated the same tokens")
    given, _ = render({"adminToken": {"value": "s3cret"}})
    if given and not any(s["data"]["token"] == "czNjcmV0" for s in by_kind(given, "Secret")):
        fail("tokens: adminToken.value is not the admin token")
    ext, _ = render({"adminToken": {"existingSecret": "mine"}, "agentToken": {"existingSecret": "ours"}})
    if ext is not None and by_kind(ext, "Secret"):
        fail("tokens: existing Secrets given, yet the chart creates Secrets")

print("== bad values are refused with the key, the value and the range", flush=True)
BAD = [
    ({"host": {"resource_policy": {"queue": {"admission_window": "45s"}}}},
     "host.resource_policy.queue.admission_window: 45s is out of range (1ms to 30s)"),
    ({"host": {"resource_policy": {"queue": {"request_deadline": "2h"}}}},
     "host.resource_policy.queue.request_deadline: 2h is out of range (1ms to 3600s)"),
    ({"host": {"resource_policy": {"queue": {"admission_window": "20s", "request_deadline": "10s"}}}},
     "host.resource_policy.queue.admission_window: 20s is above the request deadline (10s)"),
    ({"host": {"resource_policy": {"queue": {"stream_idle_timeout": "500ms"}}}},
     "host.resource_policy.queue.stream_idle_timeout: 500ms is out of range (1s to 3600s)"),
    ({"host": {"resource_policy": {"queue": {"max_pending_per_deployment": 5000}}}},
     "host.resource_policy.queue.max_pending_per_deployment: 5000 is out of range (0 to 4096)"),
    ({"host": {"resource_policy": {"queue": {"max_pending_total": 70000}}}},
     "host.resource_policy.queue.max_pending_total: 70000 is out of range (0 to 65536)"),
    ({"host": {"resource_policy": {"queue": {"max_pending_total": 1.5}}}},
     "host.resource_policy.queue.max_pending_total: `1.5` is not a whole number"),
    ({"host": {"resource_policy": {"queue": {"max_buffered_bytes_total": "32GiB"}}}},
     "host.resource_policy.queue.max_buffered_bytes_total: 32GiB is out of range (1KiB to 16GiB)"),
    ({"host": {"resource_policy": {"queue": {"max_buffered_bytes_total": "64 megs"}}}},
     "host.resource_policy.queue.max_buffered_bytes_total: `64 megs` is not a byte size"),
    ({"host": {"resource_policy": {"queue": {"admision_window": "1s"}}}},
     "host.resource_policy.queue.admision_window: unknown key; expected one of admission_window"),
    ({"host": {"lifecycle": {"activation": "manual"}}},
     "host.lifecycle.activation: `manual` is not one of on_demand, explicit"),
    ({"host": {"engines": {"vllm": {"command": []}}}},
     "host.engines.vllm.command: must be a list of strings"),
    ({"host": {"engines": {"trt": {}}}},
     "host.engines.trt: unknown key; expected one of vllm, sglang, tensorfold"),
    ({"host": {"gpus": [{"unified": True}]}},
     "host.gpus[0].memory: missing"),
    ({"host": {"id": "gpu-box"}},
     "host.id: unknown key"),
    ({"server": {"switching": {"drain_timeout": "601s"}}},
     "server.switching.drain_timeout: 601s is out of range (1s to 600s)"),
    ({"server": {"switching": {"drain_timeout": 30}}},
     "server.switching.drain_timeout: `30` is not a duration such as 500ms, 2s, 5m or 1h (a bare number is refused"),
    ({"server": {"switching": {"wake_timeout": "0s"}}},
     "server.switching.wake_timeout: 0s is out of range (1s to 3600s)"),
    ({"server": {"lifecycle_defaults": {"ready_idle_timeout": "8d"}}},
     "server.lifecycle_defaults.ready_idle_timeout: `8d` is not a duration"),
    ({"server": {"lifecycle_defaults": {"parked_idle_timeout": "169h"}}},
     "server.lifecycle_defaults.parked_idle_timeout: 169h is out of range (1s to 168h)"),
    ({"server": {"listen": {"inference": "localhost:8080"}}},
     "server.listen.inference: `localhost:8080` is not a socket address"),
    ({"server": {"swiching": {}}},
     "server.swiching: unknown key; expected one of listen, switching, lifecycle_defaults"),
    ({"gpu": {"sharing": "mig"}},
     "gpu.sharing: `mig` is not one of runtimeClass, devicePlugin"),
    ({"gpu": {"visibleDevices": "some"}},
     "gpu.visibleDevices: `some` is not one of host, all"),
    ({"nodeAgent": {"dataDir": {"hostPath": ""}}},
     "nodeAgent.dataDir.hostPath: must not be empty"),
    ({"nodeAgent": {"engineRuntime": "docker"}},
     "nodeAgent.engineRuntime: `docker` is not one of pod, process"),
    ({"operator": {"watchNamespaces": ["*", "team-a"]}},
     "operator.watchNamespaces: \"*\" (every namespace) cannot be combined with namespaces"),
    ({"operator": {"watchNamespaces": ["Team_A"]}},
     "operator.watchNamespaces: `Team_A` is not a namespace name"),
    ({"operator": {"watchNamespaces": "team-a"}},
     "operator.watchNamespaces: must be a list of namespaces"),
    ({"operator": {"leaderElection": {"holdover": "2h"}}},
     "operator.leaderElection.holdover: 2h is out of range (0s to 3600s)"),
    ({"operator": {"leaderElection": {"holdover": 90}}},
     "operator.leaderElection.holdover: `90` is not a duration such as 500ms, 2s, 5m or 1h (a bare number is refused"),
]
for values, want in BAD:
    docs, err = render(values)
    if err is None:
        fail(f"bad values {values} rendered; want an error with {want!r}")
    elif want not in err:
        fail(f"bad values {values}: error {err!r} does not contain {want!r}")
print(f"   {len(BAD)} bad values refused")

if FAILURES:
    print(f"helm-lint: {len(FAILURES)} failure(s)")
    sys.exit(1)
print("helm-lint: chart charts/capyctl passed (lint, render, documents, tokens, bad values)")
PYTHON
