#!/usr/bin/env python3
"""Write a one-layer OCI image archive (an OCI image layout in a tar) from files on this machine,
offline: the equivalent of a `FROM scratch` Dockerfile whose COPY lines are the --add arguments.
`ctr -n k8s.io images import FILE` imports it under --name (a fully qualified reference).

  oci-archive.py --out F.tar --name localhost/capyctl/x:0.1.0 \
      --add /path/on/host=/usr/local/bin/x[:mode] ... [--dir /tmp=1777] [--link /bin/sh=busybox] \
      [--tree /host/dir=/opt/dir] [--entrypoint /usr/local/bin/x] [--user 65532:65532] \
      [--env K=V] [--gzip]

The layer is a tar with fixed owners (root) and times (0), so the same files give the same
digests. Each --add is copied with its content (symbolic links followed); modes default to the
source's. --tree copies a directory whole (its symbolic links kept as links), less what an
--exclude names; an --add, --dir or --link of the same path replaces what a tree gave. Parent directories are added (0755).

The layer is written to a temporary file beside --out (not held in memory: a Python environment
of several GB fits), gzip-compressed with --gzip (level 1), and --out - writes the archive to
stdout, e.g. into `ctr images import -`, so that no archive is kept on disk.
"""
import argparse
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import zlib


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
    p.add_argument("--tree", action="append", default=[], help="SRC=DST: a directory, whole")
    p.add_argument("--exclude", action="append", default=[], help="DST: leave out what a tree has there")
    p.add_argument("--gzip", action="store_true", help="compress the layer (gzip, level 1)")
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


class HashingWriter:
    """A file-like sink: hashes what is written (the layer's diff_id), compresses it with gzip
    when asked, and writes the result to `out`, hashing that too (the blob's digest)."""

    def __init__(self, out, gzip):
        self.out = out
        self.plain = hashlib.sha256()
        self.stored = hashlib.sha256()
        self.size = 0
        self.plain_size = 0
        self.z = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS) if gzip else None

    def _store(self, data):
        if data:
            self.stored.update(data)
            self.size += len(data)
            self.out.write(data)

    def write(self, data):
        self.plain.update(data)
        self.plain_size += len(data)
        self._store(self.z.compress(data) if self.z else data)
        return len(data)

    def tell(self):
        return self.plain_size

    def close(self):
        if self.z:
            self._store(self.z.flush())


def add_tree(entries, spec):
    src, sep, dst = spec.partition("=")
    if not sep or not dst.startswith("/"):
        fail(f"--tree {spec!r}: expected SRC=/DST")
    if not os.path.isdir(src):
        fail(f"--tree {spec!r}: {src} is not a directory")
    src = src.rstrip("/") or "/"
    dst = dst.rstrip("/") or "/"
    for root, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(root, src)
        base = dst if rel == "." else os.path.join(dst, rel)
        entries[base] = (tarfile.DIRTYPE, os.stat(root).st_mode & 0o7777, None)
        for name in dirnames + filenames:
            path = os.path.join(root, name)
            if os.path.islink(path):
                entries[os.path.join(base, name)] = (tarfile.SYMTYPE, 0o777, os.readlink(path))
            elif name in filenames and os.path.isfile(path):
                entries[os.path.join(base, name)] = (tarfile.REGTYPE, os.stat(path).st_mode & 0o7777, path)


def build_layer(adds, dirs, links, trees, excludes, sink):
    entries = {}  # path in the image -> (kind, mode, source or None)
    for spec in trees:
        add_tree(entries, spec)
    for ex in excludes:
        ex = ex.rstrip("/")
        for path in [p for p in entries if p == ex or p.startswith(ex + "/")]:
            del entries[path]
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
    with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar:
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
                    tar.addfile(tarinfo(path, kind, mode, os.fstat(f.fileno()).st_size), f)
    sink.close()


def blob(tar, data, media_type, **extra):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    tar.addfile(tarinfo("blobs/sha256/" + digest.split(":")[1], tarfile.REGTYPE, 0o644, len(data)), io.BytesIO(data))
    d = {"mediaType": media_type, "digest": digest, "size": len(data)}
    d.update(extra)
    return d


def file_blob(tar, f, digest, size, media_type):
    f.seek(0)
    tar.addfile(tarinfo("blobs/sha256/" + digest.split(":")[1], tarfile.REGTYPE, 0o644, size), f)
    return {"mediaType": media_type, "digest": digest, "size": size}


def main():
    a = parse_args()
    ref = a.name
    last = ref.rsplit("/", 1)[-1]
    host = ref.split("/")[0]
    if "/" not in ref or not ("." in host or ":" in host or host == "localhost") or ":" not in last:
        fail(f"--name {ref!r}: give a fully qualified reference with a tag (e.g. localhost/capyctl/x:1)")
    tag = last.split(":", 1)[1]
    tmp_dir = os.path.dirname(os.path.abspath(a.out)) if a.out != "-" else None
    layer_file = tempfile.TemporaryFile(dir=tmp_dir, prefix=".oci-layer-")
    sink = HashingWriter(layer_file, a.gzip)
    build_layer(a.add, a.dir, a.link, a.tree, a.exclude, sink)
    layer_digest = "sha256:" + sink.plain.hexdigest()
    blob_digest = "sha256:" + sink.stored.hexdigest()
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
    out = sys.stdout.buffer if a.out == "-" else open(tmp, "wb")
    # (a pipe cannot tell its position: the stream mode writes without)
    with tarfile.open(fileobj=out, mode="w|" if a.out == "-" else "w", format=tarfile.PAX_FORMAT) as tar:
        media = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if a.gzip else "")
        layer_d = file_blob(tar, layer_file, blob_digest, sink.size, media)
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
    out.flush()
    layer_file.close()
    if a.out != "-":
        out.close()
        os.replace(tmp, a.out)
    print(f"{a.out}: {ref} ({sink.size // 1024} KiB layer, {layer_digest[:19]})", file=sys.stderr)


if __name__ == "__main__":
    main()
