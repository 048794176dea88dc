"""Extract the argument names of every public ttnn op from the wheel into
tt_backend/api_signatures.json (see README.md here for the exact command).

Runs in the ttnn venv (Python 3.12, ttnn==0.81.1); never calls an op. Sources, best first:
1. ``nb_signature``: nanobind's ``__nb_signature__`` of the C++ op's ``__call__`` (or of a plain
   nanobind function): the real binding, one entry per overload, with positional / keyword-only
   parameters and which have defaults. Docstrings can disagree with it (e.g. the docstring of
   ``ttnn.transformer.paged_scaled_dot_product_attention_decode`` lists ``cur_pos`` and
   ``share_cache``, which the binding does not accept).
2. ``inspect``: ``inspect.signature`` of Python-level ops (``ttnn.from_torch``, ``ttnn.as_tensor``...).
3. ``docstring``: the "Args:" / "Keyword args:" sections, only when neither of the above works.
Also records names of public constants (dtypes, layouts, memory configs, enums) so executors can
check the strings they map ("ttnn.bfloat8_b", "ttnn.DRAM_MEMORY_CONFIG", "ttnn.MathFidelity.HiFi2").
"""
import inspect
import json
import os
import re
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("TT_METAL_MOCK_CLUSTER_DESC_PATH", os.path.join(HERE, "wormhole_n150_mock.yaml"))
os.environ.setdefault("LOGURU_LEVEL", "WARNING")
import ttnn  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(REPO, "tt_backend", "api_signatures.json")

# Modules whose plain functions count as ops (besides FastOperation objects, found everywhere).
# Tooling modules (tracers, reports, profiler, loaders) are left out.
OP_MODULE = re.compile(r"^ttnn(\.transformer|\.experimental(\..*)?|\.kv_cache|\.operations(\..*)?|\.distributed|\.core|\.device)?$")
SKIP_MODULE = re.compile(r"^ttnn\.(decorators|reflection|stack_trace_source|tools|torch_tracer|tracer|operation_tracer"
                         r"|graph_report|profiler|comparison|config_serialization|experimental_loader)")


def _split_top(s, sep=","):
    """Split on ``sep`` outside brackets/quotes."""
    out, depth, cur, q = [], 0, [], None
    for ch in s:
        if q:
            cur.append(ch)
            if ch == q:
                q = None
            continue
        if ch in "\"'":
            q = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


def _parse_nb(sig: str):
    """'def __call__(self, a: T, b: U = \\0, *, c: V) -> R' -> overload dict."""
    m = re.match(r"def \w+\((.*)\)(?: -> .*)?$", sig, re.S)
    if not m:
        raise ValueError(sig)
    params = [p.strip() for p in _split_top(m.group(1))]
    ov = {"positional": [], "keyword_only": [], "required": [], "var_positional": False, "var_keyword": False}
    kwonly = False
    for p in params:
        if p == "self":
            continue
        if p == "*":
            kwonly = True
            continue
        if p == "/":
            continue
        if p.startswith("**"):
            ov["var_keyword"] = True
            continue
        if p.startswith("*"):
            ov["var_positional"] = True
            kwonly = True
            continue
        name = re.match(r"(\w+)", p).group(1)
        has_default = re.search(r"\s=\s", p) is not None  # nanobind writes defaults as " = \\N"
        (ov["keyword_only"] if kwonly else ov["positional"]).append(name)
        if not has_default:
            ov["required"].append(name)
    return ov


def _from_inspect(fn):
    sig = inspect.signature(fn)
    ov = {"positional": [], "keyword_only": [], "required": [], "var_positional": False, "var_keyword": False}
    for p in sig.parameters.values():
        if p.kind == p.VAR_POSITIONAL:
            ov["var_positional"] = True
        elif p.kind == p.VAR_KEYWORD:
            ov["var_keyword"] = True
        else:
            (ov["keyword_only"] if p.kind == p.KEYWORD_ONLY else ov["positional"]).append(p.name)
            if p.default is p.empty:
                ov["required"].append(p.name)
    return ov


def _from_doc(doc: str):
    ov = {"positional": [], "keyword_only": [], "required": [], "var_positional": False, "var_keyword": False}
    section = None
    for line in (doc or "").splitlines():
        s = line.strip()
        low = s.lower()
        if low in ("args:", "arguments:", "parameters:"):
            section = "positional"
            continue
        if low in ("keyword args:", "keyword arguments:", "kwargs:"):
            section = "keyword_only"
            continue
        if s.endswith(":") and not re.match(r"^\w+ *\(", s):
            section = None if re.match(r"^[A-Z][\w ]*:$", s) else section
            continue
        m = section and re.match(r"^\*{0,2}(\w+)\s*(\(([^)]*)\))?\s*:", s)
        if m and m.group(1) not in ov["positional"] + ov["keyword_only"]:
            ov[section].append(m.group(1))
            if m.group(3) is not None and "optional" not in m.group(3) and "Defaults to" not in line:
                ov["required"].append(m.group(1))
    return ov if ov["positional"] or ov["keyword_only"] else None


def signature_of(obj):
    """(source, [overloads]) or None."""
    fn = obj.function if isinstance(obj, ttnn.decorators.FastOperation) else obj
    nb = getattr(fn, "__nb_signature__", None) or getattr(getattr(type(fn), "__call__", None), "__nb_signature__", None)
    if nb and not isinstance(fn, type):
        try:
            return "nb_signature", [_parse_nb(s[0]) for s in nb]
        except Exception:
            pass
    if inspect.isfunction(fn) or inspect.ismethod(fn):
        try:
            return "inspect", [_from_inspect(fn)]
        except (TypeError, ValueError):
            pass
    ov = _from_doc(getattr(obj, "__doc__", None))
    return ("docstring", [ov]) if ov else None


def walk():
    ops, consts, types_, seen_mod = {}, {}, {}, set()

    def visit(mod, path, depth):
        if id(mod) in seen_mod or depth > 4 or SKIP_MODULE.match(path):
            return
        seen_mod.add(id(mod))
        for a in sorted(dir(mod)):
            if a.startswith("_"):
                continue
            try:
                v = getattr(mod, a)
            except Exception:
                continue
            name = f"{path}.{a}"
            if isinstance(v, types.ModuleType):
                if getattr(v, "__name__", "").startswith("ttnn"):
                    visit(v, name, depth + 1)
                continue
            is_fast = isinstance(v, ttnn.decorators.FastOperation)
            is_func = (type(v).__name__ == "nb_func" or inspect.isfunction(v)) and \
                str(getattr(v, "__module__", "") or "").startswith("ttnn") and OP_MODULE.match(path)
            is_cpp_op = type(getattr(type(v), "__call__", None)).__name__ == "nb_method" and not isinstance(v, type) \
                and OP_MODULE.match(path)
            if is_fast or is_func or is_cpp_op:
                sig = signature_of(v)
                if sig is None:
                    ops[name] = {"source": "none", "overloads": []}
                else:
                    ops[name] = {"source": sig[0], "overloads": sig[1]}
            elif isinstance(v, type) and type(v).__name__ == "nb_type" and OP_MODULE.match(path) and \
                    getattr(type(v.__init__), "__name__", "") == "nb_method":
                # config classes (compute kernel / program / memory configs): constructor keywords
                try:
                    types_[name] = [_parse_nb(s_[0]) for s_ in v.__init__.__nb_signature__]
                except Exception:
                    pass
            elif path == "ttnn" and not callable(v) or type(v).__name__ in ("DataType", "Layout", "MemoryConfig"):
                consts[name] = type(v).__name__
            elif isinstance(v, type) and type(v).__name__ in ("EnumType", "nb_enum") or hasattr(v, "__members__"):
                for member in getattr(v, "__members__", {}):
                    consts[f"{name}.{member}"] = a
        return

    visit(ttnn, "ttnn", 0)
    return ops, consts, types_


def _compact(ov):
    return {k: v for k, v in ov.items() if v not in (False, [])}


def main(out=OUT):
    from importlib.metadata import version
    ops, consts, types_ = walk()
    head = {
        "ttnn_version": version("ttnn"),
        "generator": "tools/ttnn_oracle/extract_api.py",
        "python": sys.version.split()[0],
        "sources": {s: sum(1 for o in ops.values() if o["source"] == s) for s in ("nb_signature", "inspect", "docstring", "none")},
        "overload_fields": "positional, keyword_only, required (no default), var_positional, var_keyword; empty/false omitted",
    }
    # One entry per line: small diffs when the pin moves.
    lines = ["{"] + [f"{json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
    for section, items in (("ops", {k: {"source": o["source"], "overloads": [_compact(x) for x in o["overloads"]]}
                                    for k, o in ops.items()}),
                           ("types", {k: [_compact(x) for x in v] for k, v in types_.items()}),
                           ("constants", consts)):
        body = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(items.items())]
        lines.append(f"{json.dumps(section)}: {{\n" + ",\n".join(body) + "\n}" + ("" if section == "constants" else ","))
    lines.append("}")
    with open(out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    json.load(open(out))  # well-formed
    print(f"wrote {out}: {len(ops)} ops {head['sources']}, {len(types_)} types, {len(consts)} constants, "
          f"ttnn {head['ttnn_version']}")


if __name__ == "__main__":
    main(*sys.argv[1:2])  # optional output path (the live test writes to a temporary file)
