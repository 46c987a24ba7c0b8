"""The shape of the code: no import cycles, no overlong functions, plugins apart.

Imports are read with ``ast`` (module-level and inside functions alike, since
a lazy import closes a cycle just as well), so this runs without importing
anything.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "mlx_lm_ext", *sorted(ROOT.glob("plugins/*/mlx_lm_*"))]
# Package functions stay readable at a glance; modules are split by concept,
# never to fit a line count, so only functions are measured.
MAX_FUNCTION_LINES = 80


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


def _is_argparse_block(fn):
    """A function that only declares arguments (flat by house rule, long by nature)."""
    calls = [
        n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
    ]
    adds = [c for c in calls if c.func.attr in ("add_argument", "add_argument_group")]
    return bool(adds) and len(adds) * 2 >= len(fn.body)


def long_functions():
    """``{module.function: lines}`` for package functions over the limit."""
    out = {}
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES and not _is_argparse_block(node):
                out[f"{name}.{node.name}"] = lines
    return out


def test_no_function_is_overlong():
    assert long_functions() == {}, f"over {MAX_FUNCTION_LINES} lines: {long_functions()}"


def test_the_length_check_names_an_offender(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    pkg = tmp_path / "mlx_lm_ext"
    pkg.mkdir()
    (pkg / "big.py").write_text(f"def big():\n{body}\n")
    monkeypatch.setitem(globals(), "PACKAGES", [pkg])
    assert long_functions() == {"mlx_lm_ext.big.big": MAX_FUNCTION_LINES + 2}


def private_imports(known=None):
    """``{plugin module: core modules it imports that are not public}``."""
    public = set(_public_modules()) - {"mlx_lm_ext.testing"}  # testing: tests only
    known = modules() if known is None else known
    out = {}
    for n, p in known.items():
        if n.split(".")[0] == "mlx_lm_ext":
            continue
        core = {t for t in imports(n, p, known) if t.split(".")[0] == "mlx_lm_ext"}
        if core - public:
            out[n] = sorted(core - public)
    return out


def _public_modules():
    # PUBLIC_MODULES read from api.py's source: this file imports nothing of ours.
    tree = ast.parse((ROOT / "mlx_lm_ext" / "api.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "PUBLIC_MODULES" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("mlx_lm_ext/api.py defines no PUBLIC_MODULES")


def test_plugins_import_only_the_public_plugin_api():
    assert private_imports() == {}, (
        "plugin modules importing the host's private modules (use mlx_lm_ext.api): "
        f"{private_imports()}"
    )


def test_the_private_import_check_names_an_offender(tmp_path):
    pkg = tmp_path / "mlx_lm_fake"
    pkg.mkdir()
    (pkg / "plugin.py").write_text(
        "from mlx_lm_ext.api import hookimpl\n"
        "from mlx_lm_ext import safefs\n"
        "def f():\n    from mlx_lm_ext import integration\n"
    )
    core = {n: p for n, p in modules().items() if n.split(".")[0] == "mlx_lm_ext"}
    known = dict(core, **{"mlx_lm_fake.plugin": pkg / "plugin.py"})
    assert private_imports(known) == {"mlx_lm_fake.plugin": ["mlx_lm_ext.integration"]}
