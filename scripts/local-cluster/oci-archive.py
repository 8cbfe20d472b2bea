#!/usr/bin/env python3
"""Write a one-layer OCI image archive (an OCI image layout in a tar) from files on this machine,
offline: the equivalent of a `FROM scratch` Dockerfile whose COPY lines are the --add arguments.
`ctr -n k8s.io images import FILE` imports it under --name (a fully qualified reference).

  oci-archive.py --out F.tar --name localhost/capyctl/x:0.1.0 \
      --add /path/on/host=/usr/local/bin/x[:mode] ... [--dir /tmp=1777] [--link /bin/sh=busybox] \
      [--entrypoint /usr/local/bin/x] [--user 65532:65532] [--env K=V]

The layer is an uncompressed tar with fixed owners (root) and times (0), so the same files give
the same digests. Each --add is copied with its content (symbolic links followed); modes default
to the source's. Parent directories are added (0755).
"""
import argparse
import hashlib
import io
import json
import os
import sys
import tarfile


def fail(msg):
    print(f"oci-archive: {msg}", file=sys.stderr)
    sys.exit(1)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--name", required=True, help="fully qualified reference, e.g. localhost/capyctl/x:1")
    p.add_argument("--add", action="append", default=[], help="SRC=DST[:MODE] (octal mode)")
    p.add_argument("--dir", action="append", default=[], help="DST=MODE: an empty directory")
    p.add_argument("--link", action="append", default=[], help="DST=TARGET: a symbolic link")
    p.add_argument("--entrypoint", action="append", default=[], help="repeat for each word")
    p.add_argument("--cmd", action="append", default=[], help="repeat for each word")
    p.add_argument("--user", default="")
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--workdir", default="/")
    return p.parse_args()


def tarinfo(name, kind, mode, size=0):
    ti = tarfile.TarInfo(name.lstrip("/"))
    ti.type = kind
    ti.mode = mode
    ti.size = size
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = "root"
    return ti


def build_layer(adds, dirs, links):
    entries = {}  # path in the image -> (kind, mode, source or None)
    for spec in adds:
        if "=" not in spec:
            fail(f"--add {spec!r}: expected SRC=DST[:MODE]")
        src, dst = spec.split("=", 1)
        mode = None
        if ":" in dst:
            dst, m = dst.rsplit(":", 1)
            try:
                mode = int(m, 8)
            except ValueError:
                fail(f"--add {spec!r}: mode {m!r} is not octal")
        if not dst.startswith("/"):
            fail(f"--add {spec!r}: the destination must be absolute")
        if not os.path.isfile(src):
            fail(f"--add {spec!r}: {src} is not a file")
        if mode is None:
            mode = os.stat(src).st_mode & 0o7777
        entries[dst] = (tarfile.REGTYPE, mode, src)
    for spec in dirs:
        dst, _, m = spec.partition("=")
        try:
            entries[dst.rstrip("/") or "/"] = (tarfile.DIRTYPE, int(m or "755", 8), None)
        except ValueError:
            fail(f"--dir {spec!r}: mode {m!r} is not octal")
    for spec in links:
        dst, sep, target = spec.partition("=")
        if not sep or not dst.startswith("/") or not target:
            fail(f"--link {spec!r}: expected /DST=TARGET")
        entries[dst] = (tarfile.SYMTYPE, 0o777, target)
    # parent directories
    for path in list(entries):
        parent = os.path.dirname(path)
        while parent not in ("", "/"):
            entries.setdefault(parent, (tarfile.DIRTYPE, 0o755, None))
            parent = os.path.dirname(parent)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(entries):
            kind, mode, src = entries[path]
            if kind == tarfile.DIRTYPE:
                tar.addfile(tarinfo(path, kind, mode))
            elif kind == tarfile.SYMTYPE:
                ti = tarinfo(path, kind, mode)
                ti.linkname = src
                tar.addfile(ti)
            else:
                with open(src, "rb") as f:
                    data = f.read()
                tar.addfile(tarinfo(path, kind, mode, len(data)), io.BytesIO(data))
    return buf.getvalue()


def blob(tar, data, media_type, **extra):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    tar.addfile(tarinfo("blobs/sha256/" + digest.split(":")[1], tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    d = {"mediaType": media_type, "digest": digest, "size": len(data)}
    d.update(extra)
    return d


def main():
    a = parse_args()
    ref = a.name
    last = ref.rsplit("/", 1)[-1]
    host = ref.split("/")[0]
    if "/" not in ref or not ("." in host or ":" in host or host == "localhost") or ":" not in last:
        fail(f"--name {ref!r}: give a fully qualified reference with a tag (e.g. localhost/capyctl/x:1)")
    tag = last.split(":", 1)[1]
    layer = build_layer(a.add, a.dir, a.link)
    layer_digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"] + a.env,
            "WorkingDir": a.workdir,
        },
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created_by": "scripts/local-cluster/oci-archive.py " + " ".join(a.add)}],
    }
    if a.entrypoint:
        config["config"]["Entrypoint"] = a.entrypoint
    if a.cmd:
        config["config"]["Cmd"] = a.cmd
    if a.user:
        config["config"]["User"] = a.user
    tmp = a.out + ".tmp"
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        layer_d = blob(tar, layer, "application/vnd.oci.image.layer.v1.tar")
        config_d = blob(tar, json.dumps(config, sort_keys=True).encode(), "application/vnd.oci.image.config.v1+json")
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_d,
            "layers": [layer_d],
        }
        manifest_d = blob(
            tar,
            json.dumps(manifest, sort_keys=True).encode(),
            "application/vnd.oci.image.manifest.v1+json",
            platform={"architecture": "amd64", "os": "linux"},
            annotations={"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag},
        )
        index = json.dumps({"schemaVersion": 2, "manifests": [manifest_d]}, sort_keys=True).encode()
        tar.addfile(tarinfo("index.json", tarfile.REGTYPE, 0o644, len(index)), io.BytesIO(index))
        layout = b'{"imageLayoutVersion":"1.0.0"}'
        tar.addfile(tarinfo("oci-layout", tarfile.REGTYPE, 0o644, len(layout)), io.BytesIO(layout))
    os.replace(tmp, a.out)
    print(f"{a.out}: {ref} ({len(layer) // 1024} KiB layer, {layer_digest[:19]})")


if __name__ == "__main__":
    main()
