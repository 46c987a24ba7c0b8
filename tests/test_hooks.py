"""In-process tests of the plugin manager and the Python API."""

import argparse
import sys

import pytest

from mlx_lm_ext import PluginError


def test_split_names():
    from mlx_lm_ext.plugins import split_names

    assert split_names(None) == []
    assert split_names("a") == ["a"]
    assert split_names(["a,b", "c", " b ", ""]) == ["a", "b", "c"]


def test_installed_plugins_are_discovered_but_not_imported(host, plugin_log):
    assert {"testplugin", "serveronly"} <= set(host.installed())
    assert host.distribution("testplugin") == ("mlx-lm-ext-testplugin", "1.2.3")
    assert "mlx_lm_ext_testplugin" not in sys.modules
    assert plugin_log() == []


def test_unknown_plugin_lists_installed(host):
    with pytest.raises(PluginError, match=r"unknown plugin 'nope'.*serveronly.*testplugin"):
        host.load("nope")


def test_check_command_refuses_other_commands(host):
    host.check_command("serveronly", "server")
    with pytest.raises(PluginError, match="does not extend mlx_lm.generate"):
        host.check_command("serveronly", "generate")


def test_plugin_flags_in_own_group(host):
    parser = argparse.ArgumentParser()
    group = host.add_arguments("testplugin", "generate", parser)
    assert group.title == "plugin testplugin"
    assert "--testplugin-mode" in parser.format_help()
    assert host.defaults("testplugin", "generate").testplugin_mode is None


def test_enable_passes_options_and_disable_deactivates(host, plugin_log):
    import mlx_lm_ext

    mlx_lm_ext.enable("testplugin", testplugin_mode="fast")
    assert mlx_lm_ext.enabled() == ["testplugin"]
    assert ["activate", "python", "fast"] in plugin_log()
    mlx_lm_ext.disable("testplugin")
    assert mlx_lm_ext.enabled() == []
    assert ["deactivate"] in plugin_log()


def test_enable_errors_are_clear(host):
    import mlx_lm_ext
    from mlx_lm_ext.plugins import ActivationFailed

    with pytest.raises(PluginError, match="has no option 'colour'.*testplugin_mode"):
        mlx_lm_ext.enable("testplugin", colour="red")
    with pytest.raises(PluginError, match="not allowed"):
        mlx_lm_ext.enable("testplugin", testplugin_mode="bad")
    with pytest.raises(ActivationFailed, match="failed to activate: simulated crash"):
        mlx_lm_ext.enable("testplugin", testplugin_mode="crash")
    assert mlx_lm_ext.enabled() == []


def test_dispatcher_routes_to_plugin_and_is_removed_on_disable(host, plugin_log, tiny_model):
    import mlx_lm

    import mlx_lm_ext

    gen_mod = sys.modules["mlx_lm.generate"]
    stock_step = gen_mod.speculative_generate_step
    model, tokenizer = mlx_lm.load(str(tiny_model("llama")))
    prompt = "The quick brown fox"
    stock = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)

    mlx_lm_ext.enable("testplugin")
    assert gen_mod.speculative_generate_step is not stock_step
    drafter = sys.modules["mlx_lm_ext_testplugin"].EchoDrafter()
    text = "".join(
        r.text
        for r in mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=12, draft_model=drafter
        )
    )
    assert text == stock
    assert ["speculative_generate_step"] in plugin_log()

    mlx_lm_ext.disable("testplugin")
    assert gen_mod.speculative_generate_step is stock_step


def test_boot_patches_late_imports_once():
    from mlx_lm_ext import _boot, integration, patching

    mod = sys.modules.get("mlx_lm.generate")
    if mod is None:
        import importlib

        mod = importlib.import_module("mlx_lm.generate")
    assert _boot.active()
    assert any(
        p.obj is mod and p.attr == "setup_arg_parser" and p.owner == "core"
        for p in patching.patches()
    )
    wrapped = mod.setup_arg_parser
    integration.patch(mod)  # idempotent, as importlib.reload would do
    assert mod.setup_arg_parser is wrapped
    parser = mod.setup_arg_parser()
    assert "--plugin" in parser.format_help()


def test_the_ledger_refuses_a_second_owner_and_undoes_by_owner():
    import types

    from mlx_lm_ext import patching

    # owners and attribute names from the owner table, on a stand-in object
    target = types.SimpleNamespace(stream_generate=1, _load=2)
    patching.replace("server.model", target, "stream_generate", 10)
    patching.replace("server.model", target, "stream_generate", 10)  # same owner: a no-op
    with pytest.raises(patching.PatchConflict, match="already patched by server.model"):
        patching.replace("python.generate", target, "stream_generate", 20)
    patching.wrap("server.model", target, "_load", lambda old: old * 100)
    assert (target.stream_generate, target._load) == (10, 200)
    target.rope = 3
    with patching.scoped("rope", [(target, "rope", 4)]):
        assert target.rope == 4 and patching.owned("rope")
    assert target.rope == 3 and not patching.owned("rope")
    assert patching.undo("server.model") == 2 and (target.stream_generate, target._load) == (1, 2)
    assert not patching.owned("server.model")


def test_the_ledger_refuses_what_the_owner_table_does_not_list():
    import types

    from mlx_lm_ext import patching

    target = types.SimpleNamespace(run=1, rope=2)
    with pytest.raises(ValueError, match="unknown patch owner 'lora.sampler'"):
        patching.replace("lora.sampler", target, "run", 10)
    with pytest.raises(ValueError, match="owner 'rope' does not patch 'run'"):
        patching.wrap("rope", target, "run", lambda old: old)
    with pytest.raises(ValueError, match="unknown patch owner"):
        patching.undo("no-such-owner")
    assert (target.run, target.rope) == (1, 2) and patching.patches() == [
        p for p in patching.patches() if p.obj is not target
    ]


def test_no_mlx_lm_attribute_is_assigned_outside_the_ledger():
    """Every change to mlx-lm goes through ``mlx_lm_ext/patching.py``."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = list((root / "mlx_lm_ext").glob("*.py")) + list(
        root.glob("plugins/*/mlx_lm_*/**/*.py")
    )
    pattern = re.compile(
        r"^\s*(?:setattr\(\s*(?:mod|server|provider|rg|handler|cls)\b|"
        r"(?:mod|server|provider|rg|handler|m)\.[A-Za-z_]+\s*=[^=])"
    )
    offenders = [
        f"{p.relative_to(root)}:{i}"
        for p in sources
        if p.name != "patching.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


def test_a_plugin_error_while_training_exits_2_in_one_line(host, monkeypatch, capsys):
    import types

    from mlx_lm_ext import PluginError, integration, patching, training

    lora = types.ModuleType("mlx_lm.lora")

    def train(model, loss=None, **kw):
        return loss()

    lora.train = lora.evaluate = train
    monkeypatch.setitem(sys.modules, "mlx_lm.lora", lora)

    def bad_loss():
        raise PluginError("--budget 1M is below what any path needs")

    monkeypatch.setattr(integration.plugins, "first", lambda *a, **k: bad_loss)
    training.install("some-loss", None)
    try:
        with pytest.raises(SystemExit) as exit_:
            lora.train(object())
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip() == (
            "mlx-lm-ext: error: --budget 1M is below what any path needs"
        )
    finally:
        patching.undo("lora.loss")


def test_unknown_loss_names_the_plugin_and_package_to_install(host, monkeypatch, capsys):
    from mlx_lm_ext import integration

    found = host.installed()
    monkeypatch.setattr(
        host, "installed", lambda: {k: v for k, v in found.items() if k != "flash-cce"}
    )
    for loss in ("flash-cce", "orpo"):
        with pytest.raises(SystemExit) as e:
            integration.loss_plugin(loss)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"unknown loss '{loss}'" in err and "testplugin" in err  # the installed ones
        assert "plugin flash-cce, which is not installed" in err
        assert "mlx-lm-flash-cce" in err and "pip install -e plugins/flash-cce" in err
    with pytest.raises(SystemExit):
        integration.loss_plugin("nope")
    assert "not installed" not in capsys.readouterr().err  # nothing known provides it


def test_flag_owner_finds_an_installed_plugin_without_registering_it(host, plugin_log):
    assert host.flag_owner("--testplugin-mode", "generate") == ("testplugin", "generate")
    assert host.flag_owner("--testplugin-mode", "generate", named=["testplugin"]) is None
    assert host.flag_owner("--no-such-flag", "generate") is None
    assert host.manager().get_plugin("testplugin") is None  # read, not registered


def test_prompt_progress_follows_the_cache_while_the_first_token_is_pending(monkeypatch):
    import time

    from mlx_lm.models.cache import KVCache

    from mlx_lm_ext import serving

    monkeypatch.setattr(serving, "PROGRESS_S", 0.02)
    cache = [KVCache()]
    cache[0].offset = 5  # tokens the prompt cache already held

    def tokens():
        for n in (10, 20, 30):
            cache[0].offset = 5 + n  # the prefill filling the target's cache
            time.sleep(0.3)
        yield "first token"
        yield "second token"

    seen = []
    out = list(serving._with_progress(tokens(), lambda *a: seen.append(a), cache, 40))
    assert out == ["first token", "second token"]
    assert seen[0] == (0, 40) and seen[-1] == (40, 40)  # as mlx-lm's own prefill reports
    assert {(10, 40), (20, 40), (30, 40)} & set(seen[1:-1])
    assert seen == sorted(seen) and seen.count((40, 40)) == 1


SERVER_FLAG_SRC = """
from mlx_lm_ext import hookimpl


@hookimpl
def commands():
    return ["server"]


@hookimpl
def add_arguments(command, group):
    group.add_argument("--flagged-dir", default=None)
"""


def test_a_flag_for_another_command_says_which_command(host, tmp_path, monkeypatch, capsys):
    writer = next(
        m.write_plugin_dist
        for k, m in list(sys.modules.items())
        if k.rsplit(".", 1)[-1] == "conftest" and hasattr(m, "write_plugin_dist")
    )
    writer(
        tmp_path,
        "mlx-lm-flagged",
        "0.3",
        {"mlx_lm_flagged": SERVER_FLAG_SRC},
        {"flagged": "mlx_lm_flagged"},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert host.flag_owner("--flagged-dir", "generate") == ("flagged", "server")
    with pytest.raises(SystemExit) as e:
        host.unrecognized(argparse.ArgumentParser(), ["--flagged-dir", "x"], "generate", [])
    assert e.value.code == 2
    assert (
        "--flagged-dir belongs to plugin flagged (package mlx-lm-flagged), "
        "which extends mlx_lm.server, not mlx_lm.generate"
    ) in capsys.readouterr().err
    sys.modules.pop("mlx_lm_flagged", None)


def test_spec_decode_reports_what_its_unset_flags_resolve_to(host, monkeypatch):
    """The page once showed ``drafter=None, draft_max=None`` while ngram with 10 ran."""
    pytest.importorskip("mlx_lm_spec_decode")
    from mlx_lm_ext import monitoring

    args = host.defaults("spec-decode", "server")
    args.draft_model, args.num_draft_tokens = None, None  # mlx-lm's own flags, unset
    host.activate("spec-decode", "server", args)
    monkeypatch.setattr(monitoring, "_info", monitoring.server_info(args))
    row = monitoring.effective_info(args)["plugins"][0]
    assert row["name"] == "spec-decode" and row["dist"] == "mlx-lm-spec-decode"
    opts = row["options"]
    assert (opts["--drafter"], opts["--draft-max"], opts["--num-draft-tokens"]) == ("ngram", 10, 3)
    assert opts["--ngram-max"] == 4  # a flag with a real default keeps its parsed value


def _ledger_calls():
    """``{(owner, attribute name, installer)}`` of every ledger call in the core's source."""
    import ast
    from pathlib import Path

    out = set()
    for path in sorted((Path(__file__).resolve().parents[1] / "mlx_lm_ext").glob("*.py")):
        if path.name == "patching.py":
            continue
        for top in ast.parse(path.read_text()).body:
            for node in ast.walk(top):
                func = getattr(node, "func", None)
                if not (
                    isinstance(func, ast.Attribute)
                    and getattr(func.value, "id", None) == "patching"
                    and func.attr in ("replace", "wrap", "scoped")
                ):
                    continue
                owner = node.args[0]
                assert isinstance(owner, ast.Constant), f"{path.name}: owner not a literal"
                if func.attr == "scoped":  # items: (obj, "attr", value) tuples, maybe built before
                    attrs = [
                        t.elts[1].value
                        for t in ast.walk(top)
                        if isinstance(t, ast.Tuple)
                        and len(t.elts) == 3
                        and isinstance(t.elts[1], ast.Constant)
                    ]
                else:
                    attrs = [node.args[2].value]
                out |= {(owner.value, a, f"{path.stem}.{top.name}") for a in attrs}
    return out


def test_the_owner_table_is_what_the_core_patches():
    from mlx_lm_ext import patching

    table = {(r.owner, r.attribute.rsplit(".", 1)[1], r.installer) for r in patching.OWNERS}
    calls = _ledger_calls()
    assert calls - table == set(), "patched but not in patching.OWNERS"
    assert table - calls == set(), "in patching.OWNERS but never patched"


def _resolve(path):
    """The object a table path names in the installed mlx-lm (``<arch>``: llama)."""
    from mlx_lm_ext.testing import resolve

    path = path.replace("<arch>", "llama")
    if "()." in path:  # an attribute of instances: look at a tiny model's
        from mlx_lm.models import llama

        from mlx_lm_ext.testing import tiny_config

        cls_path, attr = path.split("().")
        cls = _resolve(cls_path)
        model = llama.Model(llama.ModelArgs.from_dict(tiny_config("llama")))
        found = [m for _, m in model.named_modules() if isinstance(m, cls)]
        # A function or module (rope), or the list of layers (flush).
        assert found and all(
            callable(m.get(attr)) or isinstance(m.get(attr), list) for m in found
        ), path
        return found[0][attr]
    return resolve(path)


def test_every_attribute_in_the_owner_table_exists_in_mlx_lm():
    import importlib

    import mlx_lm

    from mlx_lm_ext import patching

    assert mlx_lm.__version__.startswith("0.32.")
    for row in patching.OWNERS:
        assert _resolve(row.attribute) is not None, row
        module, function = row.installer.split(".")
        assert callable(getattr(importlib.import_module(f"mlx_lm_ext.{module}"), function)), row


def test_the_owners_deactivation_undoes_are_owners_of_the_table():
    from mlx_lm_ext import integration, patching

    assert set(integration.NEEDS) <= {r.owner for r in patching.OWNERS}
