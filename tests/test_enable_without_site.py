"""``python -S -m mlx_lm_ext ...`` (no site processing: no ``.pth`` files and
no site-packages on ``sys.path``) runs mlx-lm's commands with the plugins
wired in, as the README says, from where the package is importable."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, cwd, env=None):
    return subprocess.run(
        [sys.executable, "-S", "-m", "mlx_lm_ext", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_python_S_from_a_checkout_runs_mlx_lm_with_plugin_flags():
    r = _run("generate", "--help", cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "--plugin NAME" in r.stdout and "--max-tokens" in r.stdout


def test_python_S_with_the_package_on_pythonpath(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = _run("plugins", cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "plugin" in r.stdout.splitlines()[0]
