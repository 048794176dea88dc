"""The dependency rules of DESIGN §2, read off the source: no import cycles, dependencies one way.

config -> plan -> layers -> model -> generate / serving; converters -> config + plan + families (+ layers' codecs);
tt_backend -> config + plan + families; jaxmodels imports converters only lazily (inside a function, for
jm.load(raw source)); nothing imports tests or notebooks; no module imports another's private names.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxmodels", "converters", "tt_backend", "serving")


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def edges(root: Path = ROOT) -> list[tuple[str, str, bool, tuple[str, ...]]]:
    """(importer, imported module, lazy = inside a function, names taken) for every import in the packages."""
    files = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    known = {_module(p, root) for p in files}
    out = []
    for path in files:
        src = _module(path, root)
        tree = ast.parse(path.read_text())
        lazy_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f) if n is not f}
        for node in ast.walk(tree):
            lazy = id(node) in lazy_nodes
            if isinstance(node, ast.Import):
                out += [(src, a.name, lazy, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:  # `from pkg import sub` imports the module pkg.sub
                    sub = f"{node.module}.{a.name}"
                    out.append((src, sub, lazy, ()) if sub in known else (src, node.module, lazy, (a.name,)))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of a directed graph (one per strongly connected component with more than one node, or a
    self-loop), each as a list of its modules."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES + ("tests", "notebooks")


def violations(es) -> list[str]:
    """Every broken rule, as a line naming the import."""
    bad = []
    graph = {}
    for src, dst, lazy, names in es:
        if not _ours(dst):
            if src == "jaxmodels.plan" and dst.split(".")[0] == "jax":
                bad.append(f"{src} imports {dst}: the plan contract is pure Python")
            continue
        graph.setdefault(src, set()).add(dst)  # lazy imports too: a cycle through a function is still a cycle
        where = f"{src} imports {dst}" + (" (lazily)" if lazy else "")
        if dst.split(".")[0] in ("tests", "notebooks"):
            bad.append(f"{where}: nothing imports tests or notebooks")
        if any(n.startswith("_") and not n.startswith("__") for n in names):
            bad.append(f"{where}: private names {[n for n in names if n.startswith('_')]}")
        if src == "jaxmodels.config" or src == "jaxmodels.plan" and dst != "jaxmodels.config":
            bad.append(f"{where}: the plan contract reads only jaxmodels.config")
        if src.startswith("jaxmodels.layers") and not dst.startswith(("jaxmodels.layers", "jaxmodels.config")):
            bad.append(f"{where}: layers are pure functions of their inputs (no executor, cache or sharding)")
        # serving runs the executor (model -> serving, as generate does); converters and tt_backend only read the plan
        if src.startswith(("converters", "tt_backend")) and dst in ("jaxmodels.model", "jaxmodels.cache"):
            bad.append(f"{where}: {src.split('.')[0]} reads the plan, not the executor")
        if src.startswith("jaxmodels") and dst.startswith("converters") and not lazy:
            bad.append(f"{where}: jaxmodels imports converters only lazily (jm.load of a raw source)")
    for cyc in cycles(graph):
        bad.append(f"import cycle: {' -> '.join(cyc)}")
    return bad


def test_the_packages_follow_the_dependency_rules():
    assert violations(edges()) == []


def test_the_checker_finds_a_planted_cycle_and_forbidden_imports(tmp_path):
    """A copy of the packages with one planted cycle (layers/mlp -> model, which imports layers) and an eager
    converters import in the plan: both are reported."""
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            q = tmp_path / p.relative_to(ROOT)
            q.parent.mkdir(parents=True, exist_ok=True)
            q.write_text(p.read_text())
    mlp = tmp_path / "jaxmodels" / "layers" / "mlp.py"
    mlp.write_text("from jaxmodels import model\n" + mlp.read_text())
    plan = tmp_path / "jaxmodels" / "plan.py"
    plan.write_text("import converters.hf\nimport jax\n" + plan.read_text())
    found = "\n".join(violations(edges(tmp_path)))
    assert "import cycle" in found and "jaxmodels.layers.mlp" in found and "jaxmodels.model" in found
    assert "jaxmodels.plan imports converters.hf: jaxmodels imports converters only lazily" in found
    assert "jaxmodels.plan imports jax: the plan contract is pure Python" in found


@pytest.mark.parametrize("graph,want", [({"a": {"b"}, "b": {"a"}}, [["a", "b"]]), ({"a": {"b"}, "b": set()}, []),
                                        ({"a": {"a"}}, [["a"]]), ({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}},
                                                                   [["a", "b", "c"]])])
def test_cycle_finder(graph, want):
    assert cycles(graph) == want
