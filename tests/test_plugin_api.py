"""The plugin API (``mlx_lm_ext.api``), how hooks are called, and the docs that list them."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "docs" / "core.md"  # the hooks, the plugin API and the ledger


def test_the_plugin_api_is_cheap_to_import_and_every_name_resolves():
    code = (
        "import sys, types, mlx_lm_ext.api as api\n"
        "heavy = [m for m in ('mlx', 'mlx.core', 'pluggy', 'prometheus_client') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "for name in api.__all__:\n"
        "    value = getattr(api, name)\n"
        "    assert isinstance(value, types.ModuleType) or value.__doc__, name\n"
        "import importlib\n"
        "for mod in api.PUBLIC_MODULES:\n"
        "    importlib.import_module(mod)\n"
        "assert callable(api.hookimpl(lambda: None))\n"
        "assert api.backbone.split and api.cache_root().name\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_name_the_api_does_not_export_is_an_attribute_error():
    from mlx_lm_ext import api

    with pytest.raises(AttributeError, match="no attribute 'integration'"):
        api.integration  # noqa: B018


def _hooks_asked_with(how):
    """Hook names the core passes to ``plugins.<how>(...)``, read from its source."""
    out = set()
    for path in (ROOT / "mlx_lm_ext").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            func = getattr(node, "func", None)
            if (
                isinstance(func, ast.Attribute)
                and func.attr == how
                and getattr(func.value, "id", None) == "plugins"
            ):
                assert isinstance(node.args[0], ast.Constant), f"{path.name}: hook not a literal"
                out.add(node.args[0].value)
    return out


def test_first_result_hooks_are_asked_with_first_and_no_spec_relies_on_pluggy_calling():
    import pluggy

    from mlx_lm_ext import hookspecs

    pm = pluggy.PluginManager("mlx_lm_ext")
    pm.add_hookspecs(hookspecs)
    specs = {name: getattr(pm.hook, name).spec for name in dir(pm.hook) if not name.startswith("_")}
    assert hookspecs.FIRST_RESULT <= set(specs)
    # the host calls hooks itself: pluggy's firstresult would be a promise nothing keeps
    assert [n for n, s in specs.items() if s.opts.get("firstresult")] == []
    assert _hooks_asked_with("first") == hookspecs.FIRST_RESULT
    others = _hooks_asked_with("collect") | _hooks_asked_with("each")
    assert others and others & hookspecs.FIRST_RESULT == set()


def test_first_and_collect_refuse_a_hook_of_the_other_kind():
    from mlx_lm_ext import plugins

    with pytest.raises(TypeError, match="'usage_fields' is asked with collect or each"):
        plugins.first("usage_fields", info={})
    with pytest.raises(TypeError, match="'make_drafter' is asked with plugins.first"):
        plugins.collect("make_drafter", command="server")


def _section(path, heading):
    """The text of the markdown section whose heading contains ``heading``."""
    text = path.read_text()
    match = re.search(rf"^(#+) [^\n]*{re.escape(heading)}[^\n]*$", text, re.M)
    assert match, f"{path.name} has no section {heading!r}"
    level = len(match.group(1))
    rest = text[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def _spec_names():
    tree = ast.parse((ROOT / "mlx_lm_ext" / "hookspecs.py").read_text())
    return [
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and any("hookspec" in ast.unparse(d) for d in n.decorator_list)
    ]


def test_the_readme_names_every_hook_and_the_plugin_api():
    section = _section(ROOT / "README.md", "Writing a plugin")
    missing = [h for h in _spec_names() if f"`{h}`" not in section]
    assert missing == [], f"README's 'Writing a plugin' lacks hooks: {missing}"
    assert "mlx_lm_ext.api" in section


def test_the_architecture_doc_lists_the_plugin_api():
    from mlx_lm_ext import api

    section = _section(ARCH, "The plugin API")
    missing = [n for n in (*api.__all__, *api.PUBLIC_MODULES) if f"`{n}" not in section]
    assert missing == [], f"docs/core.md 'The plugin API' lacks: {missing}"


def test_the_architecture_doc_lists_every_row_of_the_owner_table():
    from mlx_lm_ext import patching

    section = _section(ARCH, "How mlx-lm is patched")
    rows = {}  # owner -> the doc's attribute and "when" cells
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows.setdefault(cells[0].strip("`"), []).append(" ".join(cells[1:3]))
    assert set(rows) == {r.owner for r in patching.OWNERS}
    for r in patching.OWNERS:
        attr = r.attribute.rsplit(".", 1)[1]
        installer = r.installer.split(".")[1]
        text = " ".join(rows[r.owner])
        assert attr in text and installer.lstrip("_") in text, (r, rows[r.owner])
