"""End to end: mlx-lm's real console scripts in subprocesses, with the test plugin."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

PY = sys.executable


def bin_path(name):
    """A console script of this interpreter's environment."""
    return os.path.join(os.path.dirname(sys.executable), name)


# Every way a user starts each command.
FORMS = {
    "generate": [
        [bin_path("mlx_lm.generate")],
        [PY, "-m", "mlx_lm", "generate"],
        [PY, "-m", "mlx_lm.generate"],
        [PY, "-m", "mlx_lm_ext", "generate"],
    ],
    "server": [
        [bin_path("mlx_lm.server")],
        [PY, "-m", "mlx_lm", "server"],
        [PY, "-m", "mlx_lm.server"],
        [PY, "-m", "mlx_lm_ext", "server"],
    ],
    "lora": [
        [bin_path("mlx_lm.lora")],
        [PY, "-m", "mlx_lm", "lora"],
        [PY, "-m", "mlx_lm.lora"],
        [PY, "-m", "mlx_lm_ext", "lora"],
    ],
}
ALL_FORMS = [(c, f) for c, forms in FORMS.items() for f in forms]


@pytest.mark.parametrize(
    "command,form", ALL_FORMS, ids=[" ".join(a.rsplit("/", 1)[-1] for a in f) for _, f in ALL_FORMS]
)
def test_help_shows_plugin_flags_in_their_group(run, command, form):
    plain = run(form + ["--help"])
    assert plain.returncode == 0, plain.stderr
    assert "--plugin NAME" in plain.stdout
    assert "testplugin" in plain.stdout  # listed as installed
    assert "--testplugin-mode" not in plain.stdout  # not named: no flags
    named = run(form + ["--plugin", "testplugin", "--help"])
    assert named.returncode == 0, named.stderr
    assert "plugin testplugin:" in named.stdout
    assert "--testplugin-mode" in named.stdout
    if command == "lora":
        assert "--loss NAME" in plain.stdout


@pytest.mark.parametrize("command", ["generate", "server", "lora"])
def test_unknown_plugin_exits_2_listing_installed(run, command):
    r = run([bin_path(f"mlx_lm.{command}"), "--plugin", "nope,testplugin"])
    assert r.returncode == 2
    assert re.search(
        r"unknown plugin 'nope' \(installed plugins: [^)]*serveronly, [^)]*testplugin", r.stderr
    )
    assert "Traceback" not in r.stderr and "usage:" not in r.stderr  # one line


@pytest.mark.parametrize("command", ["generate", "server"])
def test_flag_of_a_plugin_not_named_says_which_plugin(run, command):
    r = run([bin_path(f"mlx_lm.{command}"), "--testplugin-mode", "ok", "--max-tokens", "2"])
    assert r.returncode == 2
    assert (
        "--testplugin-mode belongs to plugin testplugin (package mlx-lm-ext-testplugin): "
        "add --plugin testplugin"
    ) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = run([bin_path(f"mlx_lm.{command}"), "--testplugin-mode=ok"])
    assert r.returncode == 2 and "add --plugin testplugin" in r.stderr
    # a flag nobody owns: argparse's own message
    r = run([bin_path(f"mlx_lm.{command}"), "--no-such-flag"])
    assert r.returncode == 2 and "unrecognized arguments: --no-such-flag" in r.stderr


@pytest.mark.parametrize("command", ["generate", "server", "lora"])
def test_a_model_folder_that_does_not_exist_exits_2(run, tmp_path, command):
    missing = str(tmp_path / "no-such-model")
    cmd = [bin_path(f"mlx_lm.{command}"), "--plugin", "testplugin", "--model", missing]
    r = run(cmd + (["--train", "--data", str(tmp_path)] if command == "lora" else []))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"mlx-lm-ext: error: --model {missing}: no such folder"
    )


def test_plugin_on_command_it_does_not_extend(run):
    r = run([bin_path("mlx_lm.generate"), "--plugin", "serveronly", "--prompt", "x"])
    assert r.returncode == 2
    assert "does not extend mlx_lm.generate (it extends: mlx_lm.server)" in r.stderr


def test_bad_plugin_option_and_crashing_activation(run, tiny_model):
    model = str(tiny_model("llama"))
    cmd = [bin_path("mlx_lm.generate"), "--model", model, "--prompt", "x", "--plugin", "testplugin"]
    bad = run(cmd + ["--testplugin-mode", "bad"])
    assert bad.returncode == 2
    assert "--testplugin-mode bad is not allowed" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1  # no usage block before it
    mismatch = run(cmd + ["--testplugin-mode", "drafter-mismatch"])
    assert mismatch.returncode == 2
    assert "this drafter was made for another model" in mismatch.stderr
    assert "Traceback" not in mismatch.stderr
    crash = run(cmd + ["--testplugin-mode", "crash"])
    assert crash.returncode == 1
    assert "plugin 'testplugin' failed to activate: simulated crash" in crash.stderr
    assert "Traceback" not in crash.stderr


def test_installed_but_not_named_changes_nothing(run, plugin_log, tiny_model):
    model = str(tiny_model("llama"))
    cmd = [
        bin_path("mlx_lm.generate"),
        "--model",
        model,
        "--prompt",
        "Once upon a time",
        "--max-tokens",
        "16",
        "--ignore-chat-template",
    ]
    stock = run(cmd, env={"MLX_LM_EXT_DISABLE": "1"})
    assert stock.returncode == 0, stock.stderr
    extended = run(cmd)
    assert extended.returncode == 0, extended.stderr
    text = lambda out: out.split("==========")[1]  # noqa: E731  (timings vary)
    assert text(extended.stdout) == text(stock.stdout)
    assert plugin_log() == []  # the plugin was never even imported


def test_generate_activates_named_plugins(run, plugin_log, tiny_model):
    model = str(tiny_model("llama"))
    r = run(
        [
            bin_path("mlx_lm.generate"),
            "--model",
            model,
            "--prompt",
            "hello",
            "--max-tokens",
            "4",
            "--plugin",
            "testplugin",
            "--testplugin-mode",
            "m1",
        ]
    )
    assert r.returncode == 0, r.stderr
    events = plugin_log()
    assert ["activate", "generate", "m1"] in events
    assert ["make_drafter", "generate", True] in events


def _tiny_dataset(path):
    path.mkdir()
    text = open(__file__).read().split()
    rows = [{"text": " ".join(text[i : i + 40])} for i in range(0, 40 * 12, 40)]
    for split, part in (("train", rows[:8]), ("valid", rows[8:])):
        with open(path / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    return path


def test_lora_loss_from_flag_and_yaml(run, plugin_log, tiny_model, tmp_path):
    model = str(tiny_model("llama"))
    data = _tiny_dataset(tmp_path / "data")
    common = [
        "--model",
        model,
        "--train",
        "--data",
        str(data),
        "--iters",
        "2",
        "--batch-size",
        "2",
        "--steps-per-report",
        "1",
        "--steps-per-eval",
        "2",
        "--val-batches",
        "1",
        "--num-layers",
        "1",
    ]
    r = run(
        [
            bin_path("mlx_lm.lora"),
            *common,
            "--adapter-path",
            str(tmp_path / "a1"),
            "--loss",
            "testplugin",
        ]
    )
    assert r.returncode == 0, r.stderr
    events = plugin_log()
    assert ["activate", "lora", None] in events
    assert ["make_loss", "Model"] in events and ["loss_traced"] in events
    assert (tmp_path / "a1" / "adapters.safetensors").exists()

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("loss: testplugin\ntestplugin_mode: yaml-mode\n")
    r = run(
        [bin_path("mlx_lm.lora"), *common, "--adapter-path", str(tmp_path / "a2"), "-c", str(cfg)]
    )
    assert r.returncode == 0, r.stderr
    assert ["activate", "lora", "yaml-mode"] in plugin_log()

    r = run([bin_path("mlx_lm.lora"), *common, "--loss", "nope"])
    assert r.returncode == 2
    assert re.search(r"unknown loss 'nope' \(losses: default, [^)]*testplugin", r.stderr)
    assert "serveronly" not in r.stderr  # a plugin that does not extend lora is no loss


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(run_env, args, port):
    proc = subprocess.Popen(
        args + ["--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=run_env,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            if proc.poll() is not None:
                raise AssertionError(proc.stdout.read()) from None
            time.sleep(0.5)
    proc.kill()
    raise AssertionError("server did not start")


def _complete(port, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture
def server_env(plugin_dir, plugin_log):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), env.get("PYTHONPATH", "")])
    return env


def test_server_plugin_hooks_and_failure_keeps_serving(server_env, plugin_log, tiny_model):
    model = str(tiny_model("llama"))
    for mode in ("ok", "cache-crash"):
        port = _free_port()
        proc = _serve(
            server_env,
            [
                bin_path("mlx_lm.server"),
                "--model",
                model,
                "--plugin",
                "testplugin",
                "--testplugin-mode",
                mode,
            ],
            port,
        )
        try:
            out = _complete(port, "Hello there")
            assert out["choices"][0]["text"] is not None
        finally:
            proc.terminate()
            log = proc.communicate(timeout=30)[0]
        events = plugin_log()
        assert ["activate", "server", mode] in events
        assert ["make_prompt_cache", 10] in events
        assert ["make_drafter", "server", True] in events
        if mode == "cache-crash":
            assert "prompt cache plugin failed, using mlx-lm's own" in log


def test_mlx_lm_ext_plugins_and_doctor(run):
    r = run([bin_path("mlx-lm-ext"), "plugins"])
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("testplugin"))
    assert "mlx-lm-ext-testplugin" in line and "1.2.3" in line
    assert "mlx_lm.generate, mlx_lm.server, mlx_lm.lora" in line
    r = run([bin_path("mlx-lm-ext"), "doctor"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend" in r.stdout and "CPU" in r.stdout
    assert re.search(r"start-up hook\s+active", r.stdout)
    assert "testplugin: probe" in r.stdout
    r = run([bin_path("mlx-lm-ext"), "testplugin-hello"])
    assert r.stdout.strip() == "hello from testplugin"


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_env_sh_works_from_any_folder(tmp_path):
    script = os.path.join(REPO, "scripts", "env.sh")
    r = subprocess.run(
        ["bash", "-c", f'source "{script}" && echo "$PATH"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(":")[0] == os.path.join(REPO, ".venv", "bin")


def test_readme_command_table_lists_every_subcommand_in_one_table():
    from mlx_lm_ext import cli

    lines = open(os.path.join(REPO, "README.md")).read().splitlines()
    start = lines.index("| command | what it does |")
    table = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break  # a blank line ends a Markdown table
        table.append(line)
    documented = {m.group(1) for m in (re.match(r"\| `mlx-lm-ext ([\w-]+)", r) for r in table) if m}
    core = {"plugins", "doctor", "model", "status"}  # the core's own (plugins add more)
    assert core <= set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert core <= documented, table
