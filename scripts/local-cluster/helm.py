"""scripts/helm: helm's install, upgrade, uninstall, status and list through helm-sdkpy (see
scripts/helm for the usage)."""
import asyncio
import json
import os
import sys

import helm_sdkpy as helm
import yaml

USAGE = """usage: scripts/helm install|upgrade NAME CHART [-n NS] [--create-namespace] [-f FILE]...
                    [--set KEY=VALUE]... [--wait] [--timeout SECONDS]
       scripts/helm uninstall NAME [-n NS] [--wait] [--timeout SECONDS]
       scripts/helm status NAME [-n NS]
       scripts/helm list [-n NS]"""


def die(msg):
    print(f"Error: {msg}", file=sys.stderr)
    sys.exit(1)


def merge(base, over):
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def scalar(text):
    if text in ("true", "false"):
        return text == "true"
    if text == "null":
        return None
    try:
        return int(text)
    except ValueError:
        return text


def parse(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    cmd, rest = argv[0], argv[1:]
    opts = {"namespace": os.environ.get("HELM_NAMESPACE", "default"), "files": [], "sets": [],
            "wait": False, "timeout": 300, "create_namespace": False}
    pos = []
    i = 0
    while i < len(rest):
        a = rest[i]

        def value():
            if i + 1 >= len(rest):
                die(f"{a} needs a value")
            return rest[i + 1]

        if a in ("-n", "--namespace"):
            opts["namespace"] = value(); i += 2
        elif a.startswith("--namespace="):
            opts["namespace"] = a.split("=", 1)[1]; i += 1
        elif a in ("-f", "--values"):
            opts["files"].append(value()); i += 2
        elif a == "--set":
            opts["sets"].append(value()); i += 2
        elif a == "--wait":
            opts["wait"] = True; i += 1
        elif a == "--create-namespace":
            opts["create_namespace"] = True; i += 1
        elif a == "--timeout":
            t = value().rstrip("s")
            if not t.isdigit():
                die(f"--timeout {value()!r}: give whole seconds")
            opts["timeout"] = int(t); i += 2
        elif a.startswith("-"):
            die(f"unknown flag {a}\n{USAGE}")
        else:
            pos.append(a); i += 1
    return cmd, pos, opts


def values_of(opts):
    values = {}
    for f in opts["files"]:
        try:
            with open(f) as fh:
                doc = yaml.safe_load(fh) or {}
        except (OSError, yaml.YAMLError) as e:
            die(f"values file {f}: {e}")
        if not isinstance(doc, dict):
            die(f"values file {f}: not a mapping")
        values = merge(values, doc)
    for s in opts["sets"]:
        key, sep, val = s.partition("=")
        if not sep or not key:
            die(f"--set {s!r}: expected KEY=VALUE")
        node = {}
        cur = node
        parts = key.split(".")
        for p in parts[:-1]:
            cur[p] = {}
            cur = cur[p]
        cur[parts[-1]] = scalar(val)
        values = merge(values, node)
    return values


def summary(result):
    info = result.get("info", {}) if isinstance(result, dict) else {}
    name = result.get("name", "") if isinstance(result, dict) else ""
    ns = result.get("namespace", "") if isinstance(result, dict) else ""
    print(f"NAME: {name}\nNAMESPACE: {ns}\nSTATUS: {info.get('status', '?')}\n"
          f"REVISION: {result.get('version', '?')}")
    notes = info.get("notes")
    if notes:
        print(f"NOTES:\n{notes}")


def main():
    cmd, pos, opts = parse(sys.argv[1:])
    config = helm.Configuration(namespace=opts["namespace"], kubeconfig=os.environ.get("KUBECONFIG"))
    try:
        if cmd in ("install", "upgrade"):
            if len(pos) != 2:
                die(f"{cmd} takes NAME and CHART\n{USAGE}")
            values = values_of(opts)
            if cmd == "install":
                result = asyncio.run(helm.Install(config).run(
                    pos[0], pos[1], values=values, create_namespace=opts["create_namespace"],
                    wait=opts["wait"], timeout=opts["timeout"]))
            else:
                result = asyncio.run(helm.Upgrade(config).run(
                    pos[0], pos[1], values=values, create_namespace=opts["create_namespace"],
                    wait=opts["wait"], timeout=opts["timeout"]))
            summary(result)
        elif cmd == "uninstall":
            if len(pos) != 1:
                die(f"uninstall takes NAME\n{USAGE}")
            asyncio.run(helm.Uninstall(config).run(pos[0], wait=opts["wait"], timeout=opts["timeout"]))
            print(f'release "{pos[0]}" uninstalled')
        elif cmd == "status":
            if len(pos) != 1:
                die(f"status takes NAME\n{USAGE}")
            summary(asyncio.run(helm.Status(config).run(pos[0])))
        elif cmd == "list":
            result = asyncio.run(helm.List(config).run())
            print(json.dumps(result, indent=2, default=str))
        else:
            die(f"unknown command {cmd!r}\n{USAGE}")
    except helm.HelmError as e:
        die(str(e))


if __name__ == "__main__":
    main()
