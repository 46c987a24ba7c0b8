"""The shape of the code: no import cycles, no oversized modules, plugins apart.

Imports are read with ``ast`` (module-level and inside functions alike, since
a lazy import closes a cycle just as well), so this runs without importing
anything.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "mlx_lm_ext", *sorted(ROOT.glob("plugins/*/mlx_lm_*"))]
MAX_LINES = 520


def modules():
    """``{dotted name: path}`` of every module of the core and the plugins."""
    out = {}
    for pkg in PACKAGES:
        for path in pkg.rglob("*.py"):
            parts = path.relative_to(pkg.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports(name, path, known):
    """The project modules that module ``name`` imports."""
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                mod = f"{anchor}.{node.module}" if node.module else anchor
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            # a package's __init__ re-exporting its own modules is not a cycle
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def test_no_import_cycles():
    known = modules()
    graph = {n: imports(n, p, known) for n, p in known.items()}
    done, cycles = set(), []

    def visit(node, stack):
        if node in stack:
            cycles.append(stack[stack.index(node) :] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, stack + [node])
        done.add(node)

    for n in sorted(graph):
        visit(n, [])
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


def test_plugins_never_import_each_other():
    known = modules()
    for n, p in known.items():
        top = n.split(".")[0]
        if top == "mlx_lm_ext":
            continue
        others = {t for t in imports(n, p, known) if t.split(".")[0] not in (top, "mlx_lm_ext")}
        assert others == set(), f"{n} imports another plugin: {others}"


def test_no_module_is_a_monolith():
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    assert {n: k for n, k in long.items() if k > MAX_LINES} == {}
