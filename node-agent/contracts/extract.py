#!/usr/bin/env python3
"""Writes the contract extract of an engine release from its own Python source.

    extract.py sglang ROOT VERSION ORIGIN > sglang-VERSION.txt
    extract.py vllm   ROOT VERSION ORIGIN > vllm-VERSION.txt

ROOT is the directory holding the engine's package (`sglang/` or `vllm/`), e.g. a release wheel
unpacked, or a virtual environment's site-packages. ORIGIN says where ROOT came from (written
in the header). The source is read, never imported, except for vLLM's flags, which are taken
from its own argument parser when ROOT is importable (the installed CPU build), else from the
source.

One line per fact, tab-separated, each with the file and line it came from (relative to ROOT):

    route   METHOD  PATH    BODY    FILE:LINE   BODY: -, MODEL (required), MODEL? (optional),
                                                or json:NAME (fields read from raw JSON)
    query   METHOD  PATH    NAME    FILE:LINE   a query parameter the handler reads
    field   MODEL   NAME    required|optional   FILE:LINE
    value   MODEL   NAME    VALUE   FILE:LINE   a value a field takes (`Literal[...]`, SGLang's
                                                memory tags)
    type    MODEL   NAME    KINDS   FILE:LINE   the JSON kinds a field's annotation accepts
                                                (string, integer, number, boolean, array,
                                                object, null; comma-separated), where known
    flag    --NAME  FILE:LINE
    env     NAME    FILE:LINE   an environment variable the engine reads (vLLM's `envs.py`)
    metric  NAME    FILE:LINE

`node-agent/tests/contract.rs` checks the drivers' calls, the launch flags and the metric names
against these files. Standard library only.
"""

import ast
import os
import re
import sys

ROUTE_DECORATORS = {"get", "post", "put", "delete", "api_route"}


def rel(root, path):
    return os.path.relpath(path, root)


def parse(path):
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def const_str(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def name_of(node):
    """`X`, `mod.X` -> `X`; `Annotated[X, Body()]` -> `X` (with the Body marker seen)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def call_name(node):
    return name_of(node.func) if isinstance(node, ast.Call) else None


def unwrap_optional(node):
    """`Optional[X]` or `X | None` -> (X, True); else (node, False)."""
    if isinstance(node, ast.Subscript) and name_of(node.value) == "Optional":
        return node.slice, True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        for a, b in ((node.left, node.right), (node.right, node.left)):
            if isinstance(b, ast.Constant) and b.value is None:
                return a, True
    return node, False


def param_kind(arg, default, models):
    """What a handler parameter is: ('body', model, required), ('query', name), or None."""
    ann = arg.annotation
    if ann is None:
        return None
    marker = None
    if isinstance(ann, ast.Subscript) and name_of(ann.value) == "Annotated":
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        ann = elts[0]
        for extra in elts[1:]:
            if call_name(extra) in ("Body", "Query"):
                marker = call_name(extra)
    if default is not None and call_name(default) in ("Body", "Query"):
        marker = call_name(default)
    inner, optional = unwrap_optional(ann)
    model = name_of(inner) or ast.unparse(inner)
    if marker == "Query":
        return ("query", arg.arg)
    if model in models or marker == "Body":
        required = default is None and not optional
        return ("body", model, required)
    if model in ("int", "float", "bool", "str") and default is not None:
        return ("query", arg.arg)  # FastAPI reads a scalar with a default from the query
    return None


def handler_reads(fn):
    """Query names (`query_params.get/getlist("x")`) and raw-JSON fields (`body.get("x")`,
    required when a missing one raises) a handler reads."""
    query, fields, required = [], [], set()
    var_of = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            key = const_str(node.args[0]) if node.args else None
            if key is None:
                continue
            if node.func.attr in ("get", "getlist") and name_of(owner) == "query_params":
                query.append(key)
            elif node.func.attr == "get" and name_of(owner) == "body":
                fields.append(key)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            c = node.value
            if (
                isinstance(c.func, ast.Attribute)
                and c.func.attr == "get"
                and name_of(c.func.value) == "body"
                and c.args
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                var_of[node.targets[0].id] = const_str(c.args[0])
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            t = node.test
            if (
                isinstance(t.left, ast.Name)
                and len(t.ops) == 1
                and isinstance(t.ops[0], ast.Is)
                and isinstance(t.comparators[0], ast.Constant)
                and t.comparators[0].value is None
                and any(isinstance(s, ast.Raise) for s in node.body)
                and t.left.id in var_of
            ):
                required.add(var_of[t.left.id])
    reads_json = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "json"
        and name_of(n.func.value) in ("raw_request", "request")
        for n in ast.walk(fn)
    )
    return query, (fields if reads_json else []), required


def routes(root, files, models, out):
    for path in files:
        tree = parse(path)
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            decorated = []
            for d in fn.decorator_list:
                if not (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)):
                    continue
                verb = d.func.attr
                if verb not in ROUTE_DECORATORS or not d.args:
                    continue
                path_ = const_str(d.args[0])
                if path_ is None:
                    continue
                methods = [verb.upper()]
                if verb == "api_route":
                    methods = ["GET"]
                    for kw in d.keywords:
                        if kw.arg == "methods" and isinstance(kw.value, ast.List):
                            methods = [const_str(e) for e in kw.value.elts]
                decorated.append((path_, methods, d.lineno))
            if not decorated:
                continue
            args = fn.args.args
            defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
            body, queries = "-", []
            for arg, default in zip(args, defaults):
                kind = param_kind(arg, default, models)
                if kind and kind[0] == "body":
                    body = kind[1] + ("" if kind[2] else "?")
                elif kind and kind[0] == "query":
                    queries.append(kind[1])
            q_extra, json_fields, json_required = handler_reads(fn)
            queries += q_extra
            for path_, methods, line in decorated:
                where = f"{rel(root, path)}:{line}"
                this_body = body
                if json_fields:
                    this_body = f"json:{fn.name}"
                    for f_ in dict.fromkeys(json_fields):
                        need = "required" if f_ in json_required else "optional"
                        out.append(("field", this_body, f_, need, where))
                for m in methods:
                    out.append(("route", m, path_, this_body, where))
                    for q in dict.fromkeys(queries):
                        out.append(("query", m, path_, q, where))


def literal_values(ann):
    """The values of a `Literal[...]` annotation (also inside `Optional`)."""
    inner, _ = unwrap_optional(ann)
    if isinstance(inner, ast.Subscript) and name_of(inner.value) == "Literal":
        elts = inner.slice.elts if isinstance(inner.slice, ast.Tuple) else [inner.slice]
        return [const_str(e) for e in elts if const_str(e) is not None]
    return []


def mounted_metrics(root, files, out):
    """`GET /metrics` where a file mounts Prometheus' app there."""
    for path in files:
        if not os.path.exists(path):
            continue
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
            if re.search(r'Mount\("/metrics"', line):
                out.append(("route", "GET", "/metrics", "-", f"{rel(root, path)}:{i}"))
                return


def class_fields(tree):
    """{class: (bases, [(field, required, line)])} of the dataclass / msgspec / pydantic
    classes of a module."""
    found = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = []
        for st in node.body:
            if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                continue
            if name_of(st.annotation) == "ClassVar" or (
                isinstance(st.annotation, ast.Subscript)
                and name_of(st.annotation.value) == "ClassVar"
            ):
                continue
            required = st.value is None
            if isinstance(st.value, ast.Call) and call_name(st.value) in ("Field", "field"):
                kws = {k.arg for k in st.value.keywords}
                first = st.value.args[0] if st.value.args else None
                has_default = (
                    "default" in kws
                    or "default_factory" in kws
                    or (first is not None and not (isinstance(first, ast.Constant) and first.value is Ellipsis))
                )
                required = not has_default
            fields.append(
                (st.target.id, required, st.lineno, literal_values(st.annotation), st.annotation)
            )
        found[node.name] = ([name_of(b) for b in node.bases], fields)
    return found


def models_of(root, files):
    classes = {}
    for path in files:
        for name, (bases, fields) in class_fields(parse(path)).items():
            classes.setdefault(name, (bases, fields, rel(root, path)))
    return classes


def all_fields(classes, name, seen=()):
    bases, fields, path = classes[name]
    out = []
    for b in bases:
        if b in classes and b not in seen:
            out += all_fields(classes, b, seen + (name,))
    own = {f[0] for f in fields}
    out = [x for x in out if x[0] not in own]
    return out + [(f, req, f"{path}:{line}", values, ann) for f, req, line, values, ann in fields]


# Python annotations and the JSON kinds they accept (pydantic also takes an integer where a
# number is asked, which the check allows).
KINDS = {
    "str": {"string"},
    "int": {"integer"},
    "float": {"number"},
    "bool": {"boolean"},
    "list": {"array"},
    "List": {"array"},
    "Sequence": {"array"},
    "tuple": {"array"},
    "Tuple": {"array"},
    "set": {"array"},
    "Set": {"array"},
    "dict": {"object"},
    "Dict": {"object"},
    "Mapping": {"object"},
}


def json_kinds(node, classes):
    """The JSON kinds annotation `node` accepts, or None when any (or unknown)."""
    if node is None:
        return None
    if isinstance(node, ast.Constant):
        if node.value is None:
            return {"null"}
        if isinstance(node.value, str):  # a forward reference
            try:
                return json_kinds(ast.parse(node.value, mode="eval").body, classes)
            except SyntaxError:
                return None
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        a, b = json_kinds(node.left, classes), json_kinds(node.right, classes)
        return None if a is None or b is None else a | b
    if isinstance(node, ast.Subscript):
        head = name_of(node.value)
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Annotated":
            return json_kinds(elts[0], classes)
        if head in ("Optional", "Union"):
            kinds = set() if head == "Union" else {"null"}
            for e in elts:
                k = json_kinds(e, classes)
                if k is None:
                    return None
                kinds |= k
            return kinds
        if head == "Literal":
            kinds = set()
            for e in elts:
                v = e.value if isinstance(e, ast.Constant) else Ellipsis
                if v is None:
                    kinds.add("null")
                elif isinstance(v, bool):
                    kinds.add("boolean")
                elif isinstance(v, int):
                    kinds.add("integer")
                elif isinstance(v, str):
                    kinds.add("string")
                else:
                    return None
            return kinds
        return json_kinds(node.value, classes)
    name = name_of(node)
    if name in KINDS:
        return set(KINDS[name])
    if name in classes:
        bases = set(classes[name][0])
        if bases & {"Enum", "IntEnum", "StrEnum"}:
            if "str" in bases or "StrEnum" in bases:
                return {"string"}
            return {"integer"} if "int" in bases or "IntEnum" in bases else None
        return {"object"}
    return None


def emit_models(classes, used, out):
    for model in sorted(used):
        if model not in classes:
            continue
        for f, req, where, values, ann in all_fields(classes, model):
            out.append(("field", model, f, "required" if req else "optional", where))
            for v in values:
                out.append(("value", model, f, v, where))
            kinds = json_kinds(ann, classes)
            if kinds is not None:
                out.append(("type", model, f, ",".join(sorted(kinds)), where))


def metrics(root, files, prefix, out):
    pat = re.compile(r'name\s*=\s*"(' + re.escape(prefix) + r'[A-Za-z0-9_:]+)"')
    seen = set()
    for path in files:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                for m in pat.finditer(line):
                    if m.group(1) not in seen:
                        seen.add(m.group(1))
                        out.append(("metric", m.group(1), f"{rel(root, path)}:{i}"))


def py_files(directory):
    for base, _, names in os.walk(directory):
        for n in sorted(names):
            if n.endswith(".py"):
                yield os.path.join(base, n)


def sglang(root, out):
    srt = os.path.join(root, "sglang", "srt")
    model_files = [
        os.path.join(srt, "managers", "io_struct.py"),
        os.path.join(srt, "entrypoints", "openai", "protocol.py"),
    ]
    classes = models_of(root, [p for p in model_files if os.path.exists(p)])
    found = []
    routes(root, [os.path.join(srt, "entrypoints", "http_server.py")], classes, found)
    # `/metrics` is a mounted Prometheus app (`add_prometheus_middleware`), not a handler.
    mounted_metrics(root, list(py_files(os.path.join(srt, "utils"))), found)
    out += found
    used = {r[3].rstrip("?") for r in found if r[0] == "route" and r[3] != "-"}
    emit_models(classes, used, out)
    # The memory tags `/release_memory_occupation` and `/resume_memory_occupation` take.
    constants = os.path.join(srt, "constants.py")
    if os.path.exists(constants):
        for i, line in enumerate(open(constants, encoding="utf-8"), 1):
            m = re.match(r'GPU_MEMORY_TYPE_\w+ = "(\w+)"', line)
            if m:
                for model in ("ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"):
                    out.append(("value", model, "tags", m.group(1), f"{rel(root, constants)}:{i}"))
    # Flags: since 0.5.2x the fields of `arg_groups/fields/*.py` (`A[T, "help"]` or
    # `A[T, Arg(...)]`, `--name-with-dashes` plus aliases), and a few registered by hand in
    # `server_args.py`; before, `server_args.py`'s `parser.add_argument("--...")`.
    fields_dir = os.path.join(srt, "arg_groups", "fields")
    flag_files = list(py_files(fields_dir)) if os.path.isdir(fields_dir) else []
    for path in flag_files:
        for node in ast.walk(parse(path)):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            ann = node.annotation
            if not (isinstance(ann, ast.Subscript) and name_of(ann.value) == "A"):
                continue
            elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else []
            meta = elts[1] if len(elts) > 1 else None
            names = ["--" + node.target.id.replace("_", "-")]
            if isinstance(meta, ast.Call) and call_name(meta) == "Arg":
                kws = {k.arg: k.value for k in meta.keywords}
                if isinstance(kws.get("no_cli"), ast.Constant) and kws["no_cli"].value:
                    continue
                if "cli_name" in kws and const_str(kws["cli_name"]):
                    names[0] = const_str(kws["cli_name"])
                if isinstance(kws.get("aliases"), ast.List):
                    names += [const_str(e) for e in kws["aliases"].elts if const_str(e)]
            elif const_str(meta) is None:
                continue
            for n in names:
                out.append(("flag", n, f"{rel(root, path)}:{node.lineno}"))
    server_args = os.path.join(srt, "server_args.py")
    for node in ast.walk(parse(server_args)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "add_argument":
                for a in node.args:
                    s = const_str(a)
                    if s and s.startswith("--"):
                        out.append(("flag", s, f"{rel(root, server_args)}:{node.lineno}"))
    metric_dirs = [os.path.join(srt, "observability"), os.path.join(srt, "metrics")]
    metric_files = [p for d in metric_dirs if os.path.isdir(d) for p in py_files(d)]
    metrics(root, metric_files, "sglang:", out)


def vllm_flags_from_parser(root):
    """`vllm serve`'s flags from its own parser, each with the file and line of the field or
    `add_argument` it comes from; None when vLLM cannot be imported from ROOT."""
    sys.path.insert(0, root)
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except Exception as e:  # noqa: BLE001 - any import failure means: read the source
        print(f"# (vLLM not importable from {root}: {e}; flags read from the source)", file=sys.stderr)
        return None
    parser = make_arg_parser(FlexibleArgumentParser())
    sources = [
        os.path.join(root, "vllm", "engine", "arg_utils.py"),
        os.path.join(root, "vllm", "entrypoints", "launchers", "cli_args.py"),
    ]
    sources += [p for p in py_files(os.path.join(root, "vllm", "config"))]
    texts = {p: open(p, encoding="utf-8").read().splitlines() for p in sources if os.path.exists(p)}

    def where(flag, dest):
        for p, lines in texts.items():
            for i, line in enumerate(lines, 1):
                if f'"{flag}"' in line:
                    return f"{rel(root, p)}:{i}"
        for p, lines in texts.items():
            for i, line in enumerate(lines, 1):
                if re.match(rf"\s+{re.escape(dest)}\s*:", line):
                    return f"{rel(root, p)}:{i}"
        return "vllm serve --help=all"

    flags = []
    for action in parser._actions:
        for s in action.option_strings:
            if s.startswith("--"):
                flags.append((s, where(s, action.dest)))
    return flags


def vllm(root, out):
    v = os.path.join(root, "vllm")
    ep = os.path.join(v, "entrypoints")
    route_files = [
        p
        for p in py_files(ep)
        if os.path.basename(p) in ("api_router.py", "api_server.py", "health.py", "basic.py", "metrics.py")
        and "launchers" not in p
    ]
    model_files = [p for p in py_files(ep) if os.path.basename(p) == "protocol.py"]
    classes = models_of(root, model_files)
    found = []
    routes(root, route_files, classes, found)
    # `/metrics` is a mounted Prometheus app, not a decorated handler.
    mounted_metrics(root, [os.path.join(ep, "serve", "instrumentator", "metrics.py")], found)
    out += found
    used = {r[3].rstrip("?") for r in found if r[0] == "route" and r[3] != "-" and not r[3].startswith("json:")}
    emit_models(classes, used, out)
    flags = vllm_flags_from_parser(root)
    if flags is None:
        flags = []
        arg_utils = os.path.join(v, "engine", "arg_utils.py")
        for i, line in enumerate(open(arg_utils, encoding="utf-8"), 1):
            for m in re.finditer(r'"(--[a-z0-9-]+)"', line):
                flags.append((m.group(1), f"{rel(root, arg_utils)}:{i}"))
    seen = set()
    for flag, where in flags:
        if flag not in seen:
            seen.add(flag)
            out.append(("flag", flag, where))
    envs = os.path.join(v, "envs.py")
    for i, line in enumerate(open(envs, encoding="utf-8"), 1):
        m = re.match(r'\s+"(VLLM_[A-Z0-9_]+)":\s*lambda', line)
        if m:
            out.append(("env", m.group(1), f"{rel(root, envs)}:{i}"))
    metrics(root, list(py_files(os.path.join(v, "v1", "metrics"))), "vllm:", out)


def main():
    if len(sys.argv) != 5 or sys.argv[1] not in ("sglang", "vllm"):
        sys.exit(__doc__)
    engine, root, version, origin = sys.argv[1:]
    root = os.path.abspath(root)
    out = []
    (sglang if engine == "sglang" else vllm)(root, out)
    print(f"# {engine} {version}: the routes, request bodies, flags and metric names of its source.")
    print(f"# Source: {origin}")
    print("# Written by node-agent/contracts/extract.py; checked by node-agent/tests/contract.rs.")
    print(f"version\t{version}")
    seen = set()
    for row in out:
        key = row[:-1]
        if key in seen:
            continue
        seen.add(key)
        print("\t".join(row))


if __name__ == "__main__":
    main()
