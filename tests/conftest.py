"""Fixtures for the host's tests: a real, entry-point-registered test plugin.

The plugin is written into a temporary folder with its own ``.dist-info``
(name, version, entry points), so ``importlib.metadata`` discovers it exactly
as it discovers a pip-installed plugin: in-process through ``sys.path`` and
in subprocesses through ``PYTHONPATH``.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

PLUGIN_SRC = textwrap.dedent(
    '''
    """Test plugin: records every hook call as a JSON line in $TESTPLUGIN_LOG."""
    import json
    import os

    from mlx_lm_ext import PluginError, hookimpl


    def record(*event):
        path = os.environ.get("TESTPLUGIN_LOG")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(list(event)) + "\\n")


    record("imported")


    class EchoDrafter:
        """A draft_model marker: this plugin's speculative path handles it."""


    @hookimpl
    def commands():
        return ["generate", "server", "lora"]


    @hookimpl
    def add_arguments(command, group):
        group.add_argument("--testplugin-mode", default=None, help="test plugin behaviour")


    @hookimpl
    def activate(command, args):
        mode = getattr(args, "testplugin_mode", None)
        if mode == "bad":
            raise PluginError("--testplugin-mode bad is not allowed")
        if mode == "crash":
            raise RuntimeError("simulated crash in activate")
        record("activate", command, mode)
        MODE["mode"] = mode


    @hookimpl
    def deactivate():
        record("deactivate")


    @hookimpl
    def make_loss(name, model, args):
        if name != "testplugin":
            return None
        from mlx_lm.tuner.trainer import default_loss

        record("make_loss", type(model).__name__)

        def loss(model, batch, lengths):
            record("loss_traced")
            return default_loss(model, batch, lengths)

        return loss


    @hookimpl
    def make_prompt_cache(args, max_size):
        record("make_prompt_cache", max_size)
        if getattr(args, "testplugin_mode", None) == "cache-crash":
            raise RuntimeError("simulated prompt cache failure")
        return None


    @hookimpl
    def make_drafter(command, model, tokenizer, draft_model, args):
        record("make_drafter", command, draft_model is None)
        if getattr(args, "testplugin_mode", None) == "drafter-mismatch":
            raise PluginError("this drafter was made for another model")
        return None


    @hookimpl
    def speculative_generate_step(prompt, model, drafter, kwargs):
        if not isinstance(drafter, EchoDrafter):
            return None
        record("speculative_generate_step")
        import mlx_lm.generate as _g  # noqa: F401
        import sys

        gen = sys.modules["mlx_lm.generate"].generate_step
        keep = ("max_tokens", "sampler", "logits_processors", "prompt_cache")
        args = {k: v for k, v in kwargs.items() if k in keep}
        return ((int(t), lp, False) for t, lp in gen(prompt, model, **args))


    @hookimpl
    def add_subcommands(subparsers):
        p = subparsers.add_parser("testplugin-hello", help="test plugin command")
        p.set_defaults(func=lambda args: print("hello from testplugin") or 0)


    @hookimpl
    def doctor():
        return [("probe", "ok")]


    FINISHED = []
    MODE = {}


    @hookimpl
    def request_finished(info):
        FINISHED.append(sorted(info))


    @hookimpl
    def metrics():
        if MODE.get("mode") == "metrics-crash":
            raise RuntimeError("simulated metrics failure")
        if MODE.get("mode") == "metrics-bad":
            return ["not a metric family"]
        from mlx_lm_ext.metrics import counter

        return [counter("mlx_lm_testplugin_finished", "Requests seen", {(): len(FINISHED)})]
    '''
)

SERVER_ONLY_SRC = textwrap.dedent(
    """
    from mlx_lm_ext import hookimpl


    @hookimpl
    def commands():
        return ["server"]


    @hookimpl
    def metrics():
        from mlx_lm_ext.metrics import gauge

        return [gauge("mlx_lm_serveronly_up", "Server-only plugin is up", {(): 1})]
    """
)


def write_plugin_dist(root, dist, version, modules, entry_points):
    """Write modules plus a .dist-info, as pip would install them."""
    for name, src in modules.items():
        (root / f"{name}.py").write_text(src)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    eps = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[mlx_lm_ext.plugins]\n{eps}")


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("testplugins")
    write_plugin_dist(
        root,
        "mlx-lm-ext-testplugin",
        "1.2.3",
        {"mlx_lm_ext_testplugin": PLUGIN_SRC},
        {"testplugin": "mlx_lm_ext_testplugin"},
    )
    write_plugin_dist(
        root,
        "mlx-lm-ext-serveronly",
        "0.0.1",
        {"mlx_lm_ext_serveronly": SERVER_ONLY_SRC},
        {"serveronly": "mlx_lm_ext_serveronly"},
    )
    return root


@pytest.fixture
def plugin_log(tmp_path, monkeypatch):
    path = tmp_path / "testplugin.log"
    monkeypatch.setenv("TESTPLUGIN_LOG", str(path))

    def events():
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    return events


@pytest.fixture
def host(plugin_dir, monkeypatch):
    """In-process host with the test plugins installed; state reset after."""
    from mlx_lm_ext import patching, plugins

    monkeypatch.syspath_prepend(str(plugin_dir))
    yield plugins
    for name in list(plugins.active()):
        plugins.deactivate(name)
    for owner in {p.owner for p in patching.patches()} - {"core"}:
        patching.undo(owner)
    plugins.STATE.args.clear()
    plugins.STATE.manager = None
    for mod in ("mlx_lm_ext_testplugin", "mlx_lm_ext_serveronly"):
        sys.modules.pop(mod, None)


@pytest.fixture
def run(plugin_dir, plugin_log):
    """Run a command in a subprocess with the test plugins installed."""

    def run(args, timeout=300, env=None, **kw):
        full = dict(os.environ)
        full["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), full.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        full.update(env or {})
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=full, **kw)

    return run
