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

    target = types.SimpleNamespace(f=1, g=2)
    patching.replace("a", target, "f", 10)
    patching.replace("a", target, "f", 10)  # same owner: a no-op
    with pytest.raises(patching.PatchConflict, match="already patched by a"):
        patching.replace("b", target, "f", 20)
    patching.wrap("a", target, "g", lambda old: old * 100)
    assert (target.f, target.g) == (10, 200)
    target.k = 3
    with patching.scoped("c", [(target, "k", 4)]):
        assert target.k == 4 and patching.owned("c")
    assert target.k == 3 and not patching.owned("c")
    assert patching.undo("a") == 2 and (target.f, target.g) == (1, 2)
    assert not patching.owned("a")


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
